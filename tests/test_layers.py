"""Each package's modules form layers: no module imports, even only for type checking or late inside a
function, one that imports it back. A circle makes a change to either side a change to both, and hides
which owns what (memd's manager and its helpers were one 9-file circle)."""

from __future__ import annotations

import ast
import graphlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imports(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, wherever in the file."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).glob("*.py")):
        module = f"{package}.{path.stem}"
        found = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith(package + "."):
                    found.add(node.module)
                elif node.module == package:
                    found.update(f"{package}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith(package + "."))
    return graph


@pytest.mark.parametrize("package", ["memd", "inferd", "kvroute", "shared", "kvpool_vllm"])
def test_no_module_imports_one_that_imports_it_back(package):
    try:
        graphlib.TopologicalSorter(imports(package)).prepare()
    except graphlib.CycleError as err:
        pytest.fail(f"an import circle in {package}: {' -> '.join(err.args[1])}")


def test_the_check_sees_a_circle_through_a_type_checking_import(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(imports("pkg")).prepare()
