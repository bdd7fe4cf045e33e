"""inferd bench: kvpool against Hugging Face transformers on one tiny Llama, on CPU.

    .venv/bin/python bench/bench_inferd.py [--quick] [--json] [--threads 2]
    .venv/bin/python bench/bench_inferd.py --served [--quick] [--json]

`--served` measures decode through `inferd serve` instead, at 1 and 2 torch
threads (bench/served_decode.py); what follows describes the in-process run.

Three questions, each answered by the real code path: the `Scheduler` runs in
this process over a real memd subprocess (CPU shared memory) through a real
`MemdClient`; the reference is `AutoModelForCausalLM.generate` with its
default dynamic cache, on the very same checkpoint, prompts and torch threads,
run as its users run it: a process of its own (this script with --hf-anchor),
model loaded and generate() called on its main thread, warm. (Run from a
thread of a process whose main thread used torch, it measured 2.2x slower on
2 threads here: a harness artifact, not transformers.)
1. Decode tokens/s with 1 and with 16 requests in flight. kvpool: greedy
   requests with ignore_eos; transformers: greedy, min_new_tokens =
   max_new_tokens, (a) one request at a time, (b) the 16 prompts as one
   left-padded batch with an attention mask.
2. Time to first token of a chat's second turn after a ~1k-token first turn:
   the session's cached history (memd parks it) against a full recompute of
   history + message (fresh token ids, so no prefix-cache hit can help).
3. How much of an iteration the worker spends awaiting memd: `client.step`
   and `Scheduler.iteration` are wrapped on their instances (here only).
4. What a prompt joining running sequences costs them (kvpool alone: transformers
   has no such pass): the decoder's pass over 16 decode rows at ~1k tokens of
   context plus one prompt chunk filling the rest of `--max-batch-tokens`,
   against the two passes run apart, on pages memd handed out. A ratio near 1
   is a pass doing only the work of its parts; padding each decode row to the
   chunk's queries made it 9x.

The systems take turns: every measurement runs on both back to back (which
goes first alternates), so that whatever else the machine does at the time
weighs on both alike. Every prompt has its own random ids, so no measured
request finds another's pages in memd's prefix cache (the report checks).

Two rates, both generated tokens over wall time, the same for both systems:
- "decode": from the first token to the last; a request's first token (the
  prefill's) is not counted. One at a time: the windows are summed over
  requests. Concurrent: one window per batch, from its earliest first token
  to its latest last token (for kvpool it includes the iteration that
  prefills the prompts that did not fit the first one's token budget;
  transformers prefills the whole batch at once).
- "end to end": every generated token over submit -> last token, prefill
  included; summed over requests or batches likewise.
kvpool's times are the scheduler's own clock (`first_token_at`, and usage's
tpot for the last token); transformers' come from a streamer's `put` calls.

memd is started with READY=1 on a NOTIFY_SOCKET, as in bench_memd.py; nothing
here sleeps to wait for anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import uvloop
from tables import table

from inferd.checkpoint import load_tokenizer, load_weights, read_config
from inferd.fingerprint import model_fingerprint
from inferd.heap_policy import keep_freed_memory
from inferd.model import Batch, PagedDecoder, build_batch
from inferd.sampling import SamplingParams
from inferd.scheduler import Request, Scheduler
from inferd.tiny import make_tiny_model
from shared.client import MemdClient
from shared.full_collections import freeze_long_lived
from shared.launch import LaunchError, held_to, spawn_ready
from shared.logs import configure
from shared.ops import Free, Open

MODEL = {"arch": "llama", "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096,
         "dtype": "float32", "seed": 0}
POOL, BLOCK_SIZE = "256MiB", 16
CONCURRENT = 16            # requests in flight, and max_num_seqs
MAX_BATCH_TOKENS = 512     # inferd serve's default
START_TIMEOUT_S = 120.0
T = TypeVar("T")

# The targets; a ratio is kvpool's figure over the baseline's.
TARGET_B1 = 1.0            # kvpool decode tok/s at 1 request / transformers one at a time
TARGET_B16 = 3.0           # kvpool decode tok/s at 16 requests / transformers one at a time
TARGET_TTFT = 5.0          # recompute turn-2 TTFT / session-reuse turn-2 TTFT
TARGET_RPC = 0.05          # memd Step time / iteration time at 16 sequences


@dataclass(frozen=True)
class Sizes:
    prompt_lens: tuple[int, ...]   # of the 16 concurrent prompts; one-at-a-time prompts cycle through them
    single: int                    # requests run one at a time (each system)
    batches: int                   # rounds of 16 concurrent requests (each system)
    new_tokens: int                # generated per request
    history: int                   # turn-1 prompt tokens of the TTFT question
    history_new: int               # turn-1 generated tokens
    message: int                   # turn-2 new tokens
    ttft_trials: int
    mixed_context: int             # tokens each decode row has cached in the mixed-pass question
    mixed_trials: int


# Prompt lengths 56..71 (mean 63.5), so kvpool's sequences cross block
# boundaries in different iterations, as real traffic does, rather than all
# in the same one; transformers then really left-pads.
DEFAULT = Sizes(tuple(range(56, 72)), single=8, batches=3, new_tokens=128, history=1000, history_new=24, message=16,
                ttft_trials=3, mixed_context=1000, mixed_trials=5)
QUICK = Sizes(tuple(range(56, 72)), single=2, batches=1, new_tokens=16, history=200, history_new=8, message=8,
              ttft_trials=1, mixed_context=200, mixed_trials=1)


@dataclass(slots=True)
class Run:
    """One request's timeline (time.monotonic seconds) and its tokens."""

    tokens: list[int]
    submitted: float
    first: float
    last: float
    cached: int = 0                # prompt tokens memd already had (kvpool only)
    ttft_ms: float = 0.0


def decode_rate(groups: list[list[Run]]) -> float:
    """Tokens after each request's first, over each group's earliest first token -> its last token, summed.

    A group is requests that ran together: one request when they run one at a time.
    """
    tokens = sum(len(r.tokens) - 1 for g in groups for r in g)
    return tokens / sum(max(r.last for r in g) - min(r.first for r in g) for g in groups)


def e2e_rate(groups: list[list[Run]]) -> float:
    """Every generated token, over each group's submit -> its last token, summed."""
    tokens = sum(len(r.tokens) for g in groups for r in g)
    return tokens / sum(max(r.last for r in g) - min(r.submitted for r in g) for g in groups)


def token_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]        # 0 and 1 are <s> and </s>


# ---- memd as a subprocess ----------------------------------------------------

class Memd:
    """memd on CPU shared memory (or `device`'s), sized from the checkpoint; returns once it has said READY=1."""

    def __init__(self, tmp: Path, model_dir: Path, device: str = "cpu", pool: str = POOL) -> None:
        self.address = f"unix:{tmp / 'memd.sock'}"
        self.log = tmp / "memd.log"
        with self.log.open("wb") as log:   # a file, not a pipe: nobody has to drain it
            try:
                self.proc = spawn_ready(
                    ["memd", "--device", device, "--model", str(model_dir), "--block-size", str(BLOCK_SIZE),
                     "--pool-bytes", pool, "--listen", self.address, "--log-level", "warning"],
                    tmp, timeout_s=START_TIMEOUT_S, stderr=log.fileno())
            except LaunchError as exc:
                raise RuntimeError(f"{exc}: {self.log.read_text().strip()[-2000:]}") from None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def with_memd(prefix: str, run: Callable[[Path, str], Awaitable[T]]) -> T:
    """`run(model_dir, memd_address)` on uvloop, with the tiny model written and a memd for it, both gone after."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", **MODEL)
        memd = Memd(Path(tmp), model_dir)
        try:
            return uvloop.run(run(model_dir, memd.address))
        finally:
            memd.kill()


# ---- instruments ---------------------------------------------------------------

@dataclass(slots=True)
class Meter:
    """Seconds spent in memd Steps, in whole scheduler iterations and in forward passes."""

    rpc_s: float = 0.0
    steps: int = 0
    iteration_s: float = 0.0
    iterations: int = 0
    forward_s: float = 0.0
    forwards: int = 0

    def add(self, kind: str, seconds: float) -> None:
        if kind == "rpc":
            self.rpc_s, self.steps = self.rpc_s + seconds, self.steps + 1
        elif kind == "iteration":
            self.iteration_s, self.iterations = self.iteration_s + seconds, self.iterations + 1
        else:
            self.forward_s, self.forwards = self.forward_s + seconds, self.forwards + 1

    def as_dict(self) -> dict[str, float]:
        it = max(self.iterations, 1)
        return {"iterations": self.iterations, "steps": self.steps, "steps_per_iteration": self.steps / it,
                "iteration_ms": self.iteration_s / it * 1e3, "rpc_ms": self.rpc_s / it * 1e3,
                "forward_ms": self.forward_s / it * 1e3,
                "rpc_share": self.rpc_s / self.iteration_s if self.iteration_s else 0.0,
                "forward_share": self.forward_s / self.iteration_s if self.iteration_s else 0.0}


class Probe:
    """Wraps a method on its instance (the class is untouched); time goes to `meter` while one is set."""

    def __init__(self) -> None:
        self.meter: Meter | None = None

    def wrap_async(self, obj: object, name: str, kind: str) -> None:
        fn = getattr(obj, name)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                if self.meter is not None:
                    self.meter.add(kind, time.perf_counter() - start)
        setattr(obj, name, timed)

    def wrap(self, obj: object, name: str, kind: str) -> None:
        fn = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.meter is not None:
                    self.meter.add(kind, time.perf_counter() - start)
        setattr(obj, name, timed)


# ---- kvpool ------------------------------------------------------------------

async def kv_scheduler(model_dir: Path, address: str, name: str, max_num_seqs: int = CONCURRENT,
                       attention: str = "auto") -> tuple[MemdClient, PagedDecoder, Scheduler]:
    """inferd's scheduler in this process, attached to memd at `address` as `inferd serve` attaches: on the
    device of memd's pool."""
    config = read_config(model_dir)
    client = await MemdClient.attach(address, model=model_fingerprint(model_dir, config, BLOCK_SIZE),
                                     block_size=BLOCK_SIZE, bytes_per_token=config.bytes_per_token,
                                     name=f"{name}:{os.getpid()}")
    assert client.pool is not None
    device = client.pool.pages.device
    model = PagedDecoder(config, load_weights(model_dir, config.dtype),
                         client.pool.view(config.dtype, config.page_shape(BLOCK_SIZE)), device=device,
                         attention=attention)
    scheduler = Scheduler(client, model, load_tokenizer(model_dir), max_num_seqs=max_num_seqs,
                          max_batch_tokens=MAX_BATCH_TOKENS)
    return client, model, scheduler


async def kv_generate(scheduler: Scheduler, prompt: list[int], n: int, session: str | None = None) -> Run:
    request = Request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), session)
    scheduler.submit(request)
    tokens: list[int] = []
    while True:
        event = await request.events.get()
        if event.error is not None:
            raise RuntimeError(f"kvpool request failed: {event.error.code}: {event.error.message}")
        tokens += event.token_ids
        if event.finish_reason is not None:
            break
    usage = event.usage or {}
    last = request.first_token_at + usage["tpot_ms"] * (len(tokens) - 1) / 1e3
    return Run(tokens, request.arrived, request.first_token_at, last, int(usage["cached_tokens"]), usage["ttft_ms"])


async def kv_batch(scheduler: Scheduler, prompts: list[list[int]], n: int) -> list[Run]:
    return list(await asyncio.gather(*[kv_generate(scheduler, p, n) for p in prompts]))


# ---- transformers --------------------------------------------------------------

class Stamps:
    """A generate() streamer that only notes when each put arrives: the prompt, then every step's tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def hf_load(model_dir: Path, device: str = "cpu") -> Any:
    """The checkpoint in its own dtype, on `device`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto").to(device).eval()


def hf_generate(model: Any, prompts: list[list[int]], n: int) -> list[Run]:
    """The prompts as one left-padded batch; one Run per prompt (they share the timeline)."""
    pad = model.config.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    stamps = Stamps()
    submitted = time.monotonic()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=pad, streamer=stamps)
    first, last = stamps.times[1], stamps.times[-1]
    return [Run(out[i, width:].tolist(), submitted, first, last) for i in range(len(prompts))]


class HfAnchor:
    """transformers in a process of its own: this script with --hf-anchor, serving generate() calls on its
    main thread over a pipe (a JSON line each way). monotonic clocks are the machine's, so its times compare."""

    def __init__(self, model_dir: Path, threads: int, device: str = "cpu", cpus: set[int] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--hf-anchor", str(model_dir), "--threads",
                                      str(threads), "--device", device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=held_to(cpus))

    def generate(self, prompts: list[list[int]], n: int) -> list[Run]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "n": n}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the transformers process exited ({self.proc.wait()})")
        return [Run(**run) for run in json.loads(line)]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve_hf_anchor(model_dir: Path, threads: int, device: str) -> None:
    """--hf-anchor: load the model and answer generate() calls on this, the main, thread.

    With inferd's own heap and collector policy (the same calls `inferd serve` makes before its first pass
    and once its model is loaded): whatever either gains from them, both get."""
    torch.set_num_threads(threads)
    keep_freed_memory()
    model = hf_load(model_dir, device)
    freeze_long_lived()
    for line in sys.stdin:
        call = json.loads(line)
        runs = hf_generate(model, call["prompts"], call["n"])
        print(json.dumps([{"tokens": r.tokens, "submitted": r.submitted, "first": r.first, "last": r.last}
                          for r in runs]), flush=True)


# ---- both, interleaved ---------------------------------------------------------

async def both(i: int, kv_run: Callable[[], Awaitable[Any]], hf_run: Callable[[], Any]) -> tuple[Any, Any]:
    """One measurement on each system, back to back; which goes first alternates with `i`. transformers
    answers from its own process: this one waits on a thread, so the event loop (memd heartbeats) goes on."""
    if i % 2:
        hf_out = await asyncio.to_thread(hf_run)
        return await kv_run(), hf_out
    kv_out = await kv_run()
    return kv_out, await asyncio.to_thread(hf_run)


async def bench(model_dir: Path, address: str, sizes: Sizes, work: dict) -> dict:
    """Every measurement runs on both systems back to back, alternating which goes first, so that
    whatever else this machine does at the time weighs on both alike. transformers runs in its own
    process (HfAnchor); this process only waits for its answer, on a thread, so memd's lease heartbeats
    go on meanwhile."""
    config = read_config(model_dir)
    anchor = HfAnchor(model_dir, torch.get_num_threads())
    try:
        return await _bench(anchor, model_dir, address, sizes, work, config)
    finally:
        anchor.close()


async def _bench(anchor: HfAnchor, model_dir: Path, address: str, sizes: Sizes, work: dict, config: Any) -> dict:
    client, model, scheduler = await kv_scheduler(model_dir, address, "bench-inferd")
    probe = Probe()
    probe.wrap_async(client, "step", "rpc")
    probe.wrap_async(scheduler, "iteration", "iteration")
    probe.wrap(model, "forward", "forward")
    task = asyncio.create_task(scheduler.run())
    res: dict[str, Any] = {"kv_single": [], "hf_single": [], "kv_batch": [], "hf_batch": [],
                           "reuse": [], "recompute": [], "hf_prefill": [], "meter_1": Meter(),
                           "meter_16": Meter(), "eos": config.eos_token_ids}

    try:
        for prompts in work["warmup"]:        # first calls of each shape: allocator, kernels, lazy inits
            await both(0, lambda p=prompts: kv_batch(scheduler, p, 8), lambda p=prompts: anchor.generate(p, 8))
        for i, prompt in enumerate(work["singles"]):
            async def kv_one(p: list[int] = prompt) -> Run:
                probe.meter = res["meter_1"]
                try:
                    return await kv_generate(scheduler, p, sizes.new_tokens)
                finally:
                    probe.meter = None
            kv_run, hf_run = await both(i, kv_one, lambda p=prompt: anchor.generate([p], sizes.new_tokens)[0])
            res["kv_single"].append(kv_run)
            res["hf_single"].append(hf_run)
        for i, prompts in enumerate(work["batches"]):
            async def kv_many(ps: list[list[int]] = prompts) -> list[Run]:
                probe.meter = res["meter_16"]
                try:
                    return await kv_batch(scheduler, ps, sizes.new_tokens)
                finally:
                    probe.meter = None
            kv_runs, hf_runs = await both(i, kv_many, lambda ps=prompts: anchor.generate(ps, sizes.new_tokens))
            res["kv_batch"].append(kv_runs)
            res["hf_batch"].append(hf_runs)
        for i, turn in enumerate(work["turns"]):
            session = f"bench-{os.getpid()}-{i}"
            first = await kv_generate(scheduler, turn["history"], sizes.history_new, session)
            history = len(turn["history"]) + len(first.tokens)
            fresh = turn["fresh"][:history + len(turn["message"])]       # same length, ids memd never saw
            res["history_len"] = history
            res["reuse"].append(await kv_generate(scheduler, turn["message"], 1, session))
            res["recompute"].append(await kv_generate(scheduler, fresh, 1))
            res["hf_prefill"].append((await asyncio.to_thread(anchor.generate, [fresh], 1))[0])
            await scheduler.reset(session)
        res["mixed"] = await mixed_pass(client, model, model_dir, sizes, random.Random(1))
        if task.done():
            task.result()                     # the scheduler died: say why
    finally:
        task.cancel()
        await client.close()
    return res


async def mixed_pass(client: MemdClient, model: PagedDecoder, model_dir: Path, sizes: Sizes,
                     rng: random.Random) -> dict[str, Any]:
    """Median ms of a decode step of CONCURRENT rows, of a prompt chunk after cached tokens, and of both as one pass.

    Where decode rows attend through the paged kernel, the decode step runs again attending over a gathered
    copy of the pages (`inferd serve --attention gather`), on the same weights and pages; where the linear
    weights are laid out for oneDNN, it runs again with them as the checkpoint has them; where the layers'
    norms, RoPE and K/V store run as inferd's CPU ops, it runs again with torch's ops. The pages come
    from memd (Open with a reserve) and are freed after; what they hold does not matter to the time, so
    nothing is prefilled. Passes run on a thread, as inferd's forward thread runs them."""
    vocab, context = model.config.vocab_size, sizes.mixed_context
    chunk = MAX_BATCH_TOKENS - CONCURRENT
    others = {}
    if model.attention == "paged" or model.weight_layout != "checkpoint" or model.fused:
        checkpoint = load_weights(model_dir, model.config.dtype)
        if model.attention == "paged":
            others["decode_gather"] = PagedDecoder(model.config, checkpoint, model.kv, attention="gather")
        if model.weight_layout != "checkpoint":
            others["decode_unpacked"] = PagedDecoder(model.config, checkpoint, model.kv, attention=model.attention,
                                                     pack_weights=False)
        if model.fused:
            others["decode_unfused"] = PagedDecoder(model.config, checkpoint, model.kv, attention=model.attention,
                                                    fused=False)
    opened = await client.step(*[Open(token_ids(rng, context, vocab), reserve=1) for _ in range(CONCURRENT)],
                               Open(token_ids(rng, context + chunk, vocab)))
    try:
        decode = [([rng.randrange(2, vocab)], context, r.block_ids) for r in opened[:-1]]
        joining = (token_ids(rng, chunk, vocab), context, opened[-1].block_ids)
        batches = {"decode": build_batch(decode, BLOCK_SIZE), "chunk": build_batch([joining], BLOCK_SIZE),
                   "mixed": build_batch([*decode[:CONCURRENT // 2], joining, *decode[CONCURRENT // 2:]], BLOCK_SIZE)}
        passes = {name: (model, batch) for name, batch in batches.items()}
        passes |= {name: (other, batches["decode"]) for name, other in others.items()}
        times: dict[str, list[float]] = {name: [] for name in passes}
        for decoder, batch in passes.values():
            await asyncio.to_thread(decoder.forward, batch)                  # warm: this shape's first pass
        for _ in range(sizes.mixed_trials):
            for name, (decoder, batch) in passes.items():
                start = time.perf_counter()
                await asyncio.to_thread(decoder.forward, batch)
                times[name].append((time.perf_counter() - start) * 1e3)
        shares = decode_pass_shares(model, batches["decode"], sizes.mixed_trials)
    finally:
        await client.step(*[Free(r.seq_id) for r in opened])
    res: dict[str, Any] = {f"{name}_ms": statistics.median(ts) for name, ts in times.items()}
    res |= {"attention": model.attention, "weight_layout": model.weight_layout, "fused": model.fused,
            "decode_shares": shares,
            "context": context, "chunk": chunk,
            "ratio": res["mixed_ms"] / (res["decode_ms"] + res["chunk_ms"])}
    return res


# Where a decode pass's CPU time goes, by torch.profiler's self time per op: the matrix products against
# reading the context (the K/V gather through the block tables, and attention over what it gathered).
PASS_PARTS = {"matmul": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"), "kv_gather": ("aten::index_select",),
              "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                            "aten::_scaled_dot_product_attention_math", "kvpool::paged_decode")}


def decode_pass_shares(model: PagedDecoder, batch: Batch, passes: int) -> dict[str, float]:
    """Each part's share of a decode pass's self CPU time, over `passes` passes (warm), the rest as "other".

    They run on this thread, under the profiler: its records are of the thread that starts it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(passes):
            model.forward(batch)
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(self_us.values())
    shares = {part: sum(self_us.get(op, 0.0) for op in ops) / total for part, ops in PASS_PARTS.items()}
    shares["other"] = 1.0 - sum(shares.values())
    return shares


# ---- report --------------------------------------------------------------------

def verdict(value: float, target: float, below: bool = False) -> str:
    ok = value < target if below else value >= target
    return "PASS" if ok else "FAIL"


def compare_tokens(kv: list[Run], hf: list[Run], eos: tuple[int, ...]) -> dict[str, int]:
    """Requests whose greedy tokens agree, and those that first part where kvpool picks </s>.

    ignore_eos lets kvpool pick </s> and go on; transformers' min_new_tokens masks </s> out, so
    where </s> is the greedy choice the two must differ from there on.
    """
    same = at_eos = 0
    for a, b in zip(kv, hf, strict=True):
        split = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)) if x != y), None)
        same += split is None
        at_eos += split is not None and a.tokens[split] in eos
    return {"same_tokens": same, "differ_at_eos": at_eos, "compared": len(kv)}


def summarise(raw: dict) -> dict:
    reuse = statistics.median(r.ttft_ms for r in raw["reuse"])
    recompute = statistics.median(r.ttft_ms for r in raw["recompute"])
    kv_runs = raw["kv_single"] + [r for b in raw["kv_batch"] for r in b]
    one_kv, one_hf = [[r] for r in raw["kv_single"]], [[r] for r in raw["hf_single"]]
    res = {
        "kvpool_b1_decode": decode_rate(one_kv), "kvpool_b1_e2e": e2e_rate(one_kv),
        "kvpool_b16_decode": decode_rate(raw["kv_batch"]), "kvpool_b16_e2e": e2e_rate(raw["kv_batch"]),
        "hf_b1_decode": decode_rate(one_hf), "hf_b1_e2e": e2e_rate(one_hf),
        "hf_b16_decode": decode_rate(raw["hf_batch"]), "hf_b16_e2e": e2e_rate(raw["hf_batch"]),
        "history_len": raw["history_len"], "ttft_reuse_ms": reuse, "ttft_recompute_ms": recompute,
        "ttft_hf_prefill_ms": statistics.median((r.first - r.submitted) * 1e3 for r in raw["hf_prefill"]),
        "reuse_cached_tokens": [r.cached for r in raw["reuse"]],
        "recompute_cached_tokens": [r.cached for r in raw["recompute"]],
        "measured_cached_tokens": sum(r.cached for r in kv_runs),
        "iterations_1": raw["meter_1"].as_dict(), "iterations_16": raw["meter_16"].as_dict(),
    }
    res |= compare_tokens(raw["kv_single"] + [r for b in raw["kv_batch"] for r in b],
                          raw["hf_single"] + [r for b in raw["hf_batch"] for r in b], raw["eos"])
    res["ratio_b1"] = res["kvpool_b1_decode"] / res["hf_b1_decode"]
    res["ratio_b16"] = res["kvpool_b16_decode"] / res["hf_b1_decode"]
    res["ratio_ttft"] = recompute / reuse
    res["rpc_share"] = res["iterations_16"]["rpc_share"]
    res["mixed_pass"] = raw["mixed"]
    res["mixed_pass_ratio"] = raw["mixed"]["ratio"]
    return res


def report(res: dict, sizes: Sizes) -> str:
    lens = sizes.prompt_lens
    head = (f"inferd bench: {res['cores']} cores, torch {res['torch']} with {res['threads']} threads (both systems), "
            f"transformers {res['transformers']}\nmodel: llama, {MODEL['layers']} layers, hidden {MODEL['hidden']}, "
            f"{MODEL['heads']} heads / {MODEL['kv_heads']} kv heads, vocab {MODEL['vocab']}, fp32, seed 0; "
            f"memd --device cpu --pool-bytes {POOL} --block-size {BLOCK_SIZE}\n"
            f"prompts {min(lens)}-{max(lens)} tokens (mean {statistics.fmean(lens):.1f}), {sizes.new_tokens} "
            f"generated each, greedy, EOS ignored; per system {sizes.single} requests one at a time and "
            f"{sizes.batches} x {CONCURRENT} concurrent, the systems interleaved; kvpool max_num_seqs {CONCURRENT}, "
            f"max_batch_tokens {MAX_BATCH_TOKENS}")
    f = lambda x: f"{x:,.1f}"  # noqa: E731
    rates = table([
        ["tok/s (generated / wall)", "decode", "end to end"],
        ["kvpool, 1 request at a time", f(res["kvpool_b1_decode"]), f(res["kvpool_b1_e2e"])],
        [f"kvpool, {CONCURRENT} concurrent", f(res["kvpool_b16_decode"]), f(res["kvpool_b16_e2e"])],
        ["transformers, 1 request at a time", f(res["hf_b1_decode"]), f(res["hf_b1_e2e"])],
        [f"transformers, {CONCURRENT} as one padded batch", f(res["hf_b16_decode"]), f(res["hf_b16_e2e"])],
    ])
    rates += ("\ndecode: first token -> last, first tokens not counted (concurrent: earliest first token of the "
              "batch -> its last token);\nend to end: submit -> last token, prefill included.")
    ttft = table([
        [f"turn-2 TTFT, {res['history_len']}-token history + {sizes.message}-token message", "median ms",
         "cached tok"],
        ["kvpool, session reuse", f"{res['ttft_reuse_ms']:.1f}", str(res["reuse_cached_tokens"][0])],
        ["kvpool, full recompute (fresh ids)", f"{res['ttft_recompute_ms']:.1f}",
         str(res["recompute_cached_tokens"][0])],
        ["transformers, full prefill (reference)", f"{res['ttft_hf_prefill_ms']:.1f}", "-"],
    ])
    ttft += f"\n({sizes.ttft_trials} trials; kvpool TTFT is usage.ttft_ms: submit -> first token)"
    one, many = res["iterations_1"], res["iterations_16"]
    rows = [["kvpool per iteration (means)", "iters", "iteration ms", "forward ms", "Step RPC ms", "Steps/iter",
             "RPC share"]]
    for label, m in (("1 sequence", one), (f"{CONCURRENT} sequences", many)):
        rows.append([label, str(m["iterations"]), f"{m['iteration_ms']:.2f}",
                     f"{m['forward_ms']:.2f} ({m['forward_share']:.0%})", f"{m['rpc_ms']:.3f}",
                     f"{m['steps_per_iteration']:.3f}", f"{m['rpc_share']:.1%}"])
    rpc = table(rows)
    rpc += ("\nSteps and iterations are timed by wrapping client.step and Scheduler.iteration on their "
            "instances;\nforward runs on inferd's forward thread inside the iteration (or ran there ahead of it).")
    m = res["mixed_pass"]
    mixed = table([
        [f"one pass (prompt joining {CONCURRENT} decode rows)", "median ms"],
        [f"{CONCURRENT} decode rows, {m['context']} tokens of context each", f"{m['decode_ms']:.1f}"],
        [f"a {m['chunk']}-token prompt chunk after {m['context']} cached", f"{m['chunk_ms']:.1f}"],
        ["both in one pass", f"{m['mixed_ms']:.1f}"],
    ])
    mixed += f"\nboth / (decode + chunk): {m['ratio']:.2f}x (the decoder alone, on pages from memd)"
    mixed += f"\ndecode rows attend through: {m['attention']}"
    if "decode_gather_ms" in m:
        mixed += (f"; over a gathered copy instead, the decode pass takes {m['decode_gather_ms']:.1f} ms "
                  f"({m['decode_gather_ms'] / m['decode_ms']:.2f}x)")
    if "decode_unpacked_ms" in m:
        mixed += (f"; with the linear weights as the checkpoint lays them out (not oneDNN's), "
                  f"{m['decode_unpacked_ms']:.1f} ms ({m['decode_unpacked_ms'] / m['decode_ms']:.2f}x)")
    if "decode_unfused_ms" in m:
        mixed += (f"; with the norms, RoPE and K/V store as torch's ops (not inferd's), "
                  f"{m['decode_unfused_ms']:.1f} ms ({m['decode_unfused_ms'] / m['decode_ms']:.2f}x)")
    mixed += (f"\nthe {CONCURRENT}-row decode pass's CPU time (profiler, self time): "
              + ", ".join(f"{part.replace('_', ' ')} {share:.0%}" for part, share in m["decode_shares"].items()))
    targets = table([
        ["target (from the issue)", "measured", "target", "result"],
        ["kvpool 1 request / transformers 1 at a time (decode)", f"{res['ratio_b1']:.2f}x", f">= {TARGET_B1:.1f}x",
         verdict(res["ratio_b1"], TARGET_B1)],
        [f"kvpool {CONCURRENT} concurrent / transformers 1 at a time (decode)", f"{res['ratio_b16']:.2f}x",
         f">= {TARGET_B16:.1f}x", verdict(res["ratio_b16"], TARGET_B16)],
        ["turn-2 TTFT: recompute / session reuse", f"{res['ratio_ttft']:.2f}x", f">= {TARGET_TTFT:.1f}x",
         verdict(res["ratio_ttft"], TARGET_TTFT)],
        [f"memd Step RPC share of iteration time ({CONCURRENT} seqs)", f"{res['rpc_share']:.1%}",
         f"< {TARGET_RPC:.0%}", verdict(res["rpc_share"], TARGET_RPC, below=True)],
    ])
    notes = (f"kvpool's greedy tokens equal transformers' in {res['same_tokens']}/{res['compared']} requests; "
             f"{res['differ_at_eos']} more part where greedy picks </s> (kvpool's ignore_eos emits it, "
             f"transformers' min_new_tokens masks it);\nprefix-cache hits in the measured decode runs: "
             f"{res['measured_cached_tokens']} tokens")
    return "\n\n".join([head, rates, ttft, rpc, mixed, targets, notes])


def served_main(args: argparse.Namespace, sizes: Sizes, work: dict) -> None:
    """--served: a fresh `inferd serve` per thread count, one memd; the ratios the targets name."""
    import served_decode

    counts = (args.threads,) if args.quick else (1, 2)
    with tempfile.TemporaryDirectory(prefix="inferd-bench-served-") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", **MODEL)
        memd = Memd(Path(tmp), model_dir)
        try:
            runs = [served_decode.served(model_dir, memd.address, Path(tmp), n, work, sizes.new_tokens)
                    for n in counts]
        finally:
            memd.kill()
    res = {"cores": os.cpu_count(), "torch": torch.__version__, "quick": args.quick, "served": runs,
           "decode_b1_ratio_vs_hf": min(r["b1_ratio"] for r in runs),
           "decode_b16_ratio_vs_hf_padded": min(r["b16_ratio"] for r in runs),
           "agreement": min(r["agreement"] for r in runs)}
    rows = [["decode tok/s through inferd serve", "threads", "kvpool", "transformers", "ratio"]]
    for r in runs:
        rows.append(["1 request at a time", str(r["threads"]), f"{r['kvpool_b1_decode']:,.0f}",
                     f"{r['hf_b1_decode']:,.0f}", f"{r['b1_ratio']:.2f}x"])
        rows.append([f"{CONCURRENT} concurrent / one padded batch", str(r["threads"]), f"{r['kvpool_b16_decode']:,.0f}",
                     f"{r['hf_b16_padded_decode']:,.0f}", f"{r['b16_ratio']:.2f}x"])
    print(f"inferd serve bench: {res['cores']} cores, torch {res['torch']}, {sizes.new_tokens} new tokens per "
          f"request, {len(work['singles'])} single requests and {len(work['batches'])} batches per thread count\n")
    print(table(rows))
    print(f"\nboth held to the same cores (the first N for N threads), transformers with inferd's heap and "
          f"collector policy; greedy completions agreeing with transformers' (or parting where kvpool picks "
          f"</s>): {100 * res['agreement']:.0f}%")
    print("\ninferd's passes, as its metrics time them (mean ms each, with sampling): " + "; ".join(
        f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}: " + ", ".join(
            f"{r[f'inferd_{kind}_passes']:.0f} {kind} {r[f'inferd_{kind}_pass_ms']:.2f}"
            for kind in ("decode", "prefill", "mixed")) for r in runs))
    print("inferd's full garbage collections (each stops decode): " + ", ".join(
        f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}: {r['inferd_full_collections']:.0f}, longest "
        f"{r['inferd_longest_full_collection_ms']:.1f} ms" for r in runs))
    if args.json:
        print(json.dumps(res))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run (small sizes)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads, for both systems (default: 2)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    p.add_argument("--served", action="store_true",
                   help="decode through inferd serve (its own process, HTTP) at 1 and 2 threads (--quick: --threads)")
    p.add_argument("--hf-anchor", type=Path, metavar="MODEL_DIR", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)      # the anchor's
    args = p.parse_args()
    configure("info", "console")          # as the daemons log: a failure's traceback without its locals
    if args.hf_anchor is not None:
        serve_hf_anchor(args.hf_anchor, args.threads, args.device)
        return
    sizes = QUICK if args.quick else DEFAULT
    torch.set_num_threads(args.threads)
    import transformers

    rng = random.Random(0)
    vocab = MODEL["vocab"]
    # Every prompt its own random ids: no measured request finds another's pages in memd's prefix cache.
    batch = lambda: [token_ids(rng, n, vocab) for n in sizes.prompt_lens]  # noqa: E731
    work = {
        "warmup": [[token_ids(rng, 40, vocab)], [token_ids(rng, 40, vocab) for _ in range(CONCURRENT)]],
        "singles": [token_ids(rng, sizes.prompt_lens[i % CONCURRENT], vocab) for i in range(sizes.single)],
        "batches": [batch() for _ in range(sizes.batches)],
        "turns": [{"history": token_ids(rng, sizes.history, vocab), "message": token_ids(rng, sizes.message, vocab),
                   "fresh": token_ids(rng, sizes.history + sizes.history_new + sizes.message, vocab)}
                  for _ in range(sizes.ttft_trials)],
    }
    if args.served:
        served_main(args, sizes, work)
        return
    keep_freed_memory()                 # as `inferd serve` does; the anchor's process keeps glibc's defaults
    raw = with_memd("inferd-bench-", lambda model_dir, address: bench(model_dir, address, sizes, work))
    res = {"cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
           "threads": torch.get_num_threads(), "quick": args.quick, **summarise(raw)}
    print(report(res, sizes))
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
