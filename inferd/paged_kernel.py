"""inferd's CPU decode attention over the pool's pages, built once per machine from `paged_attention.cpp`.

A decode step gathered each sequence's pages into one tensor and handed it to
scaled_dot_product_attention, reading the whole context twice and writing it
once; at 1,000 tokens of context that was 80% of a 16-sequence step of the
bench model. `torch.ops.kvpool.paged_decode` reads the keys and values where
they lie, once.

No kernel of the field fits: the CPU builds of FlashInfer, flash-attn and
vLLM's paged attention don't exist or are pinned to other torch releases, and
torch's flex attention compiles through Inductor, 30 s per shape. So the
kernel is one C++ file, compiled by the machine's C++ compiler (`$CXX`, else
c++) against the installed torch the first time inferd starts, as FlashInfer
builds its kernels, and kept in `$XDG_CACHE_HOME/kvpool/kernels` under a name
that changes with the source, torch, the compiler and the CPU. `inferd
build-kernel` builds it ahead of time. Where it cannot be built (no
compiler), inferd says so once and attends through the gathered copy.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("inferd.paged_kernel")

SOURCE = Path(__file__).with_name("paged_attention.cpp")
# No errno or trapping math: without them the softmax's exp and max loops do not vectorise.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC",
         "-std=c++20", "-w"]

_loaded: bool | None = None          # None: not tried in this process


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why in one line."""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpool" / "kernels"


def _cpu_flags() -> str:
    """What -march=native compiles for: the library built on one CPU may not run on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI),
                                    platform.machine(), _cpu_flags(), version, *FLAGS]).encode()).hexdigest()
    return cache_dir() / f"paged_attention-{key[:16]}.so"


def build() -> Path:
    """The kernel's shared library, compiled unless the cache holds it; one process compiles at a time."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
    target = library_path(cxx)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():                      # another process built it while this one waited
            return target
        log.info("building the paged attention kernel, once for this machine", path=str(target))
        torch_dir = Path(torch.__file__).parent
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            command = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                       f"-I{torch_dir / 'include'}", str(SOURCE), f"-L{torch_dir / 'lib'}", "-lc10",
                       "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(out)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise KernelUnavailable(f"{Path(cxx).name} failed on {SOURCE.name}: {last}")
            os.replace(out, target)              # whole or not at all, for the next process to load
    return target


def load() -> bool:
    """Whether `torch.ops.kvpool.paged_decode` is there, building and loading it on the first call."""
    global _loaded
    if _loaded is None:
        try:
            torch.ops.load_library(str(build()))
            _loaded = True
        except (KernelUnavailable, OSError) as err:
            log.warning("decode attends through a gathered copy of K/V: the paged kernel is unavailable",
                        error=str(err))
            _loaded = False
    return _loaded


def available(*, required: bool) -> bool:
    """`load()`, raising KernelUnavailable where the kernel is `required` and missing."""
    if load():
        return True
    if required:
        raise KernelUnavailable("the paged kernel could not be built or loaded (inferd build-kernel says why)")
    return False


def paged_decode(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q [B, heads, dim] (one new token per row), cache [blocks, 2, block_size, kv_heads, dim] (one
    layer's pages), tables [B, blocks] and lens [B] (keys per row, its new one included) → [B, heads * dim]."""
    return torch.ops.kvpool.paged_decode(q, cache, tables, lens, scale)
