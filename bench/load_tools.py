"""The load tools users point at an inference server, each installed once into a venv of its own under
~/.cache/kvpool-bench, never into kvpool's: aiperf (NVIDIA's) and inference-perf (the Kubernetes serving
working group's).

inference-perf declares Python >= 3.12. Its venv is made with a 3.12 (or newer) interpreter where one is
found (on the PATH, or among pyenv's versions); where none is, with this one, its declaration overridden
(`--ignore-requires-python`, wheels only, so that pip picks dependency versions built for this Python),
and the bench says which in its report.

    python bench/load_tools.py        set both up (`.ci/run` does, before the suite); print their paths
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from vllm_anchor import cache_dir

AIPERF = "0.13.0"
INFERENCE_PERF = "0.7.0"


def newer_python() -> str | None:
    """A Python 3.12 or newer that runs, for inference-perf: on the PATH, else one of pyenv's; None if none."""
    candidates = [found for name in ("python3.14", "python3.13", "python3.12") if (found := shutil.which(name))]
    if pyenv := shutil.which("pyenv"):
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        candidates += sorted((str(p) for p in Path(root).glob("versions/3.1[2-9]*/bin/python3")), reverse=True)
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info >= (3, 12))"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "True":     # a pyenv shim of no active version fails
            return candidate
    return None


def inference_perf_python_note() -> str:
    """What the report says of the interpreter inference-perf runs on (its venv's)."""
    config = cache_dir() / f"inference-perf-{INFERENCE_PERF}" / "pyvenv.cfg"
    version = next((line.split("=", 1)[1].strip() for line in config.read_text().splitlines()
                    if line.startswith("version")), "?") if config.exists() else "?"
    parts = version.split(".")
    if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit() and (int(parts[0]), int(parts[1])) >= (3, 12):
        return f"on Python {version}"
    return (f"on Python {version}: it declares 3.12 or newer and none was found here, so its venv was made with "
            "pip's --ignore-requires-python")


def _venv(name: str, version: str, package: str, python: str, extra: list[str]) -> Path:
    """The tool's entry point in its cached venv, made on first use; RuntimeError with pip's last line if not."""
    venv = cache_dir() / f"{name}-{version}"
    tool, done = venv / "bin" / name, venv / ".kvpool-ready"
    if done.exists():
        return tool
    steps = [[python, "-m", "venv", "--clear", str(venv)],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *extra, f"{package}=={version}"]]
    for step in steps:
        ran = subprocess.run(step, capture_output=True, text=True)
        if ran.returncode:
            lines = [line for line in ran.stderr.strip().splitlines() if not line.startswith("WARNING: Location")]
            raise RuntimeError(f"setting up {package} {version} in {venv}: {(lines or ['no output'])[-1]}")
    done.touch()
    return tool


def aiperf() -> Path:
    return _venv("aiperf", AIPERF, "aiperf", sys.executable, [])


def inference_perf() -> Path:
    newer = newer_python()
    if newer is not None:
        return _venv("inference-perf", INFERENCE_PERF, "inference-perf", newer, [])
    return _venv("inference-perf", INFERENCE_PERF, "inference-perf", sys.executable,
                 ["--ignore-requires-python", "--only-binary=:all:"])


if __name__ == "__main__":
    print(aiperf())
    print(inference_perf())
