"""vLLM's own allocator, loaded from its published wheel, as the anchor `bench_memd.py` measures memd's against.

vLLM (0.33) keeps free KV blocks in `FreeKVCacheBlockQueue`, a doubly linked
list threaded through `KVCacheBlock` objects, and allocates and frees through
`BlockPool.get_new_blocks` / `free_blocks`: the same policy as memd's
`BlockPool` (uncached blocks reused first, cached ones least recently freed
first). Importing the `vllm` package would pull in its whole runtime, so the two
modules that define these classes are executed from the wheel's source with
vLLM-internal imports left out: the classes run as vLLM wrote them, and
nothing of vLLM is copied into kvpool. The wheel is fetched once with
`pip download --no-deps` and kept in a cache directory.
"""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

VERSION = "0.33.0"
MODULES = ("vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/block_pool.py")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpool-bench"


def wheel(version: str = VERSION) -> Path:
    """The wheel, downloaded once; raises RuntimeError with pip's last line when it cannot be had."""
    where = cache_dir()
    found = sorted(where.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"vllm=={version}",
                           "--dest", str(where)], capture_output=True, text=True)
    found = sorted(where.glob(f"vllm-{version}-*.whl"))
    if done.returncode or not found:
        last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise RuntimeError(f"pip download vllm=={version}: {last}")
    return found[0]


def load(path: Path) -> SimpleNamespace:
    """`KVCacheBlock`, `FreeKVCacheBlockQueue` and `BlockPool` as the wheel defines them."""
    namespace: dict = {"__name__": "vllm_anchor", "init_logger": logging.getLogger, "MEDIUM_GPU": "GPU"}
    with zipfile.ZipFile(path) as archive:
        for module in MODULES:
            _execute(ast.parse(archive.read(module).decode()), namespace)
    missing = [name for name in ("KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool") if name not in namespace]
    if missing:
        raise RuntimeError(f"vllm {VERSION} wheel: {', '.join(missing)} did not load")
    return SimpleNamespace(**{k: namespace[k] for k in ("KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool")})


def _execute(tree: ast.Module, namespace: dict) -> None:
    """Each top-level statement on its own: imports of vLLM bind stand-in types (they only annotate), and a
    statement that needs more of vLLM than that is skipped; the classes measured need none."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
            for alias in node.names:
                namespace.setdefault(alias.asname or alias.name, type(alias.name, (), {}))
            continue
        if isinstance(node, ast.Import) and any(a.name.startswith("vllm") for a in node.names):
            continue
        try:
            exec(compile(ast.Module([node], []), "<vllm>", "exec"), namespace)      # vLLM's own code, from its wheel
        except Exception:          # a helper vLLM defines for other uses, needing more of vLLM
            continue
