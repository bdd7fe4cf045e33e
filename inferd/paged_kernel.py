"""inferd's CPU kernels, built once per machine: decode attention over the pool's pages, and a layer's small steps.

A decode step gathered each sequence's pages into one tensor and handed it to
scaled_dot_product_attention, reading the whole context twice and writing it
once; at 1,000 tokens of context that was 80% of a 16-sequence step of the
bench model. `torch.ops.kvpool.paged_decode` (`paged_attention.cpp`) reads
the keys and values where they lie, once. `torch.ops.kvpool.rms_norm` and
`rope_store` (`layer_kernels.cpp`) do in one op each what took a layer a
dozen small torch ops: a decode step of the bench model ran 16-18% faster.

No kernel of the field fits: the CPU builds of FlashInfer, flash-attn and
vLLM's paged attention don't exist or are pinned to other torch releases, and
torch's flex attention compiles through Inductor, 30 s per shape. So the
kernels are C++ files, compiled by the machine's C++ compiler (`$CXX`, else
c++) against the installed torch the first time inferd starts, as FlashInfer
builds its kernels, and kept in `$XDG_CACHE_HOME/kvpool/kernels` under a name
that changes with the sources, torch, the compiler and the CPU. `inferd
build-kernel` builds them ahead of time. Where they cannot be built (no
compiler), inferd says so once, attends through the gathered copy and runs
the layers with torch's ops.
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

# Each source with the flags it alone needs: the layers' ops round a product before adding it, as torch does,
# where the attention kernel's products and sums are better fused.
SOURCES = {Path(__file__).with_name("paged_attention.cpp"): [],
           Path(__file__).with_name("layer_kernels.cpp"): ["-ffp-contract=off"]}
# No errno or trapping math: without them the softmax's exp and max loops do not vectorise.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-std=c++20", "-w"]

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
    sources = [f"{path.read_text()}{flags}" for path, flags in SOURCES.items()]
    key = hashlib.sha256("\0".join([*sources, torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI),
                                    platform.machine(), _cpu_flags(), version, *FLAGS]).encode()).hexdigest()
    return cache_dir() / f"kernels-{key[:16]}.so"


def build() -> Path:
    """The kernels' shared library, compiled unless the cache holds it; one process compiles at a time."""
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
        log.info("building inferd's CPU kernels, once for this machine", path=str(target))
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            _compile(cxx, Path(tmp), out)
            os.replace(out, target)              # whole or not at all, for the next process to load
    return target


def _compile(cxx: str, tmp: Path, out: Path) -> None:
    """Each source to an object, all at once (a few seconds each), then one library of them."""
    torch_dir = Path(torch.__file__).parent
    common = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
              f"-I{torch_dir / 'include'}"]
    objects = {source: tmp / f"{source.stem}.o" for source in SOURCES}
    compiling = {source: subprocess.Popen([*common, *flags, "-c", str(source), "-o", str(objects[source])],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for source, flags in SOURCES.items()}
    failed = None
    for source, job in compiling.items():
        _, err = job.communicate()
        if job.returncode != 0 and failed is None:
            failed = (source.name, _last_line(err))
    if failed is None:
        link = subprocess.run([cxx, "-shared", "-fopenmp", *map(str, objects.values()), f"-L{torch_dir / 'lib'}",
                               "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(out)],
                              capture_output=True, text=True, check=False)
        if link.returncode != 0:
            failed = ("the kernels' objects", _last_line(link.stderr))
    if failed is not None:
        raise KernelUnavailable(f"{Path(cxx).name} failed on {failed[0]}: {failed[1]}")


def _last_line(output: str) -> str:
    """A compiler's verdict: the last line it wrote."""
    return (output.strip().splitlines() or ["no output"])[-1]


def load() -> bool:
    """Whether inferd's ops (`torch.ops.kvpool.*`) are there, building and loading them on the first call."""
    global _loaded
    if _loaded is None:
        try:
            torch.ops.load_library(str(build()))
            _loaded = True
        except (KernelUnavailable, OSError) as err:
            log.warning("decode attends through a gathered copy of K/V and the layers run torch's ops: the paged "
                        "kernel is unavailable", error=str(err))
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
