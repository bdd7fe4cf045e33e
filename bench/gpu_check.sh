#!/usr/bin/env bash
# kvpool's GPU checks, run from the repository root on a machine with an NVIDIA GPU:
#
#     OUT=/some/dir bash bench/gpu_check.sh [smoke|full]
#
# The machine needs python3 with torch (CUDA, with Triton), transformers, tokenizers, safetensors, numpy,
# msgpack, uvloop, xxhash, prometheus-client, rich, pytest (+ pytest-timeout) and cuda-python; the wheels in
# .whl/ (grpcio, protobuf, structlog, grpcio-health-checking, grpcio-reflection, shtab, pytest-asyncio,
# starlette, uvicorn, pydantic and theirs) go to /tmp/site, ahead of whatever is installed. The project is not
# installed: PYTHONPATH has the repository, and the daemons start as `python3 -m memd` / `-m inferd`.
#
# smoke: a few minutes' first look: the GPU decode bench on a tiny checkpoint (memd's pool on the GPU,
# inferd's scheduler over it, flex attention reading the pages against the gathered copy, transformers on
# the same GPU), the first CUDA test, flex attention over pools of 4 GiB and past 2**31 elements, and over
# query groups padded to a power of two, and the swap tier's copies of scattered pages.
# full, each step bounded by `timeout`, each independent of the others' outcome, all inside a total budget
# (a step that would start past it is skipped):
#   a. tests/test_cuda_ipc.py: CUDA IPC between processes; the paged decoder on a GPU pool against
#      transformers on the same GPU; a second turn on another worker; swap and drop round trips
#   e. bench_gpu_decode: decode tok/s at 1/16/64 requests and turn-2 TTFT on a Llama-1B-shaped checkpoint,
#      against transformers on the same GPU; a 3 GiB pool, which flex attention takes (under 2**31 elements);
#      then a window of served decode at each concurrency under torch's profiler and py-spy ($OUT/profile/)
#   c. bench_swap --device cuda:0: pool <-> pinned swap tier bandwidth, Step latency in a swap storm
#   b. vmm_probe: can a cuMemCreate pool exported as a POSIX fd outlive its exporter?
# Results: $OUT/gpu.log (everything), $OUT/pytest_cuda.xml, $OUT/bench_gpu_decode.json,
# $OUT/bench_swap_cuda.json, $OUT/vmm_probe.json, $OUT/profile/ (bench/step_profile.py).

MODE=${1:-full}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
LOG=$OUT/gpu.log
: > "$LOG"
export PYTHONUNBUFFERED=1
BUDGET_S=${BUDGET_S:-$([[ $MODE == smoke ]] && echo 210 || echo 530)}
START=$SECONDS
SUMMARY=()

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl 2>&1 | tee -a "$LOG"
export PYTHONPATH=/tmp/site:$PWD

# pytest-asyncio 1.5 needs pytest >= 8.4: bring ours (.whl/pytest/) only where the machine's is older.
if ! python3 -c 'import sys, pytest; sys.exit(tuple(map(int, pytest.__version__.split(".")[:2])) < (8, 4))' 2>/dev/null; then
    echo "pytest older than 8.4 (or missing): installing .whl/pytest/*" | tee -a "$LOG"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/pytest/*.whl 2>&1 | tee -a "$LOG"
fi

# py-spy (.whl/tools/), for bench_gpu_decode's --profile: its binary lands in /tmp/tools/bin.
if ls .whl/tools/py_spy-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tools \
        .whl/tools/py_spy-*.whl 2>&1 | tee -a "$LOG"
    export PATH=/tmp/tools/bin:$PATH
fi

# Console scripts, for anything that calls them by name (the tests and benches use `python3 -m`).
mkdir -p /tmp/bin
for pair in memd:memd memctl:memd.memctl inferd:inferd inferctl:inferd.inferctl; do
    printf '#!/bin/sh\nexec python3 -m %s "$@"\n' "${pair#*:}" > "/tmp/bin/${pair%%:*}"
    chmod +x "/tmp/bin/${pair%%:*}"
done
export PATH=/tmp/bin:$PATH

run_step() {     # run_step NAME MAX_SECONDS COMMAND...: output to the log, bounded by the step's and the total budget
    local name=$1 max=$2 left t t0 rc
    shift 2
    left=$(( BUDGET_S - (SECONDS - START) ))
    if (( left < 20 )); then
        echo "=== SKIPPED $name: the total budget of ${BUDGET_S}s is spent" | tee -a "$LOG"
        SUMMARY+=("$name: SKIPPED (budget)")
        return
    fi
    t=$(( max < left ? max : left ))
    echo "=== $name (timeout ${t}s, started $(date -u +%H:%M:%S), $((SECONDS - START))s in)" | tee -a "$LOG"
    t0=$SECONDS
    ( set -o pipefail; timeout -k 10 "$t" "$@" 2>&1 | tee -a "$LOG" )
    rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
    SUMMARY+=("$name: rc=$rc in $((SECONDS - t0))s$( (( rc == 124 || rc == 137 )) && echo ' (TIMED OUT)')")
}

{
    echo "=== environment"
    date -u
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,compute_mode,persistence_mode,mig.mode.current \
        --format=csv 2>&1
    uname -r
    echo "user $(id -un), ulimit -l $(ulimit -l), cpus $(nproc)"
    env | grep -E '^(PYTORCH|CUDA|NVIDIA|NCCL)' || true
    python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device 0:", p.name, f"{p.total_memory / 2**30:.1f} GiB", "uuid", p.uuid)
    print("matmul tf32:", torch.backends.cuda.matmul.allow_tf32)
for name in ("grpc", "google.protobuf", "structlog", "grpc_health", "grpc_reflection", "shtab", "pytest",
             "pytest_asyncio", "pytest_timeout", "hypothesis", "transformers", "tokenizers", "safetensors",
             "msgpack", "uvloop", "prometheus_client", "rich", "numpy", "cuda.bindings", "cupy", "triton", "xxhash",
             "starlette", "uvicorn", "pydantic"):
    try:
        mod = importlib.import_module(name)
        version = getattr(mod, "__version__", None) or getattr(mod, "VERSION", "?")
        print(f"  {name:<18} {str(version):<12} {getattr(mod, '__file__', '')}")
    except Exception as exc:
        print(f"  {name:<18} NOT IMPORTABLE: {type(exc).__name__}: {exc}")
import memd.__main__, inferd.__main__, shared.rpc.memd_pb2, shared.rpc.inferd_pb2  # noqa: E401
print("kvpool imports: ok")
if torch.cuda.is_available():
    from inferd import flex_decode
    for gib in (1, 16):                      # the GPU bench's Llama-1B shape, bfloat16: pools of 1 and 16 GiB
        why = flex_decode.unavailable(torch.device("cuda:0"), 16, 32, 8, 64, pool_elements=gib << 29)
        print(f"flex decode on cuda:0, a {gib} GiB pool, 16-token pages, 32/8 heads of 64:", why or "available")
EOF
} 2>&1 | tee -a "$LOG"

keep_json() {   # keep_json FILE: the last line of /tmp/step.out, where it is a JSON object
    if [[ -s /tmp/step.out ]] && tail -n 1 /tmp/step.out | grep -q '^{'; then tail -n 1 /tmp/step.out > "$1"; fi
}

if [[ $MODE == smoke ]]; then
    run_step "e. bench_gpu_decode --quick (tiny checkpoint)" 80 \
        bash -c 'set -o pipefail; python3 bench/bench_gpu_decode.py --quick --device cuda:0 --pool 1GiB --json \
                 | tee /tmp/step.out'
    keep_json "$OUT/bench_gpu_decode_quick.json"
    run_step "a. pytest tests/test_cuda_ipc.py: the first test, flex on large pools" 110 \
        python3 -m pytest -v -rA -p no:cacheprovider --junitxml="$OUT/pytest_cuda.xml" \
        "tests/test_cuda_ipc.py::test_generate_on_a_gpu_pool_matches_transformers_on_the_gpu" \
        "tests/test_cuda_ipc.py::test_flex_decode_reads_pages_across_a_large_pool_as_a_gathered_copy" \
        "tests/test_cuda_ipc.py::test_flex_decode_pads_query_groups_to_the_kernels_power_of_two" \
        "tests/test_cuda_ipc.py::test_gpu_swap_moves_scattered_pages_to_scattered_slots_and_back"
else
    run_step "a. pytest tests/test_cuda_ipc.py" 180 \
        python3 -m pytest -v -rA -p no:cacheprovider --junitxml="$OUT/pytest_cuda.xml" tests/test_cuda_ipc.py
    run_step "e. bench_gpu_decode (Llama-1B shape)" 260 \
        bash -c 'set -o pipefail; python3 bench/bench_gpu_decode.py --device cuda:0 --pool 3GiB --json \
                 --profile "$0/profile" | tee /tmp/step.out' "$OUT"
    keep_json "$OUT/bench_gpu_decode.json"
    run_step "c. bench_swap --device cuda:0" 60 \
        bash -c 'set -o pipefail; python3 bench/bench_swap.py --device cuda:0 --seconds 2 --moved 256MiB \
                 --repeats 3 --json | tee /tmp/step.out'
    keep_json "$OUT/bench_swap_cuda.json"
    run_step "b. vmm_probe (CUDA VMM pool as POSIX fds)" 30 \
        python3 bench/vmm_probe.py --size 64MiB --json-out "$OUT/vmm_probe.json"
fi

{
    echo "=== after the steps"
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>&1
    echo "=== summary ($((SECONDS - START))s in all)"
    printf '%s\n' "${SUMMARY[@]}"
} 2>&1 | tee -a "$LOG"
exit 0
