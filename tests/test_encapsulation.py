"""One owner per piece of state: no module reaches into another class's underscored members.

A class's underscored attributes and methods are its own: the code that
changes them is in the class, where its invariants are. Another class (or a
function) that reads or writes them bypasses that; it asks the class instead,
or gets a value back to apply (as memd ops hand the scheduler an outcome:
`inferd.memd_ops`). The check is by name: an `x._name` anywhere but in a class
that defines `_name` itself is a finding. Other packages' privates (argparse's,
torch's) are not ours to keep, and not checked.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("memd", "inferd", "kvroute", "shared")
KNOWN: set[tuple[str, str]] = set()          # (file, name) reaches still to be taken out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _classes() -> list[tuple[str, ast.ClassDef]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            found += [(str(path.relative_to(ROOT)), node) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    return found


def _members(cls: ast.ClassDef) -> set[str]:
    """The underscored names a class defines: methods, class attributes, and `self._x = ...` anywhere in it."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name) and _private(target.id):
                    names.add(target.id)
    return names


def _findings() -> list[str]:
    owners: dict[str, set[str]] = defaultdict(set)
    for _, cls in _classes():
        for name in _members(cls):
            owners[name].add(cls.name)
    findings = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            tree = ast.parse(path.read_text(), rel)
            findings += _reaches(tree, rel, owners)
    return findings


def _reaches(tree: ast.Module, rel: str, owners: dict[str, set[str]]) -> list[str]:
    out = []

    def visit(node: ast.AST, inside: ast.ClassDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child)
                continue
            if isinstance(child, ast.Attribute) and _private(child.attr) and child.attr in owners:
                own = inside is not None and child.attr in _members(inside)
                if not own and (rel, child.attr) not in KNOWN:
                    out.append(f"{rel}:{child.lineno}: {ast.unparse(child)} (a member of "
                               f"{', '.join(sorted(owners[child.attr]))})")
            visit(child, inside)

    visit(tree, None)
    return out


def test_no_module_reaches_into_another_class_s_underscored_members():
    assert _findings() == []


def test_the_check_finds_a_reach_into_another_class():
    tree = ast.parse("class A:\n    def f(self, s):\n        return s._end()\n")
    assert _reaches(tree, "x.py", {"_end": {"Scheduler"}}) == ["x.py:3: s._end (a member of Scheduler)"]
    own = ast.parse("class Scheduler:\n    def _end(self):\n        pass\n    def f(self, other):\n"
                    "        other._end()\n")
    assert _reaches(own, "x.py", {"_end": {"Scheduler"}}) == []
