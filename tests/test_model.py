"""The paged decoder against transformers on the same tiny weights, with pages from a real memd."""

from __future__ import annotations

import random
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from inferd.checkpoint import CheckpointError, load_weights, read_config
from inferd.layer_stack import PassGraphs
from inferd.model import PagedDecoder, build_batch
from inferd.tiny import make_tiny_model
from shared.client import MemdClient
from shared.ops import Extend, Open

transformers = pytest.importorskip("transformers")

BS = 4                     # tokens per block: small, so prompts cross many block boundaries
DECODE_STEPS = 64
ATOL = 2e-4                # fp32, logits of order 10


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def checkpoint(request, tmp_path_factory) -> Path:
    # llama with Llama 3 rope scaling (short original context, so the scaling matters here)
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=3,
                           llama3_rope=request.param == "llama")


def inapplicable(params: dict) -> bool:
    """Flex decode reads pages alike for every architecture: the llama checkpoint covers it (tests/required.py)."""
    return params.get("worker") == "flex" and params.get("checkpoint") != "llama"


@pytest.fixture(scope="module")
def flex_checkpoint(tmp_path_factory) -> Path:
    """The llama checkpoint alone, for tests of flex decode itself."""
    return make_tiny_model(tmp_path_factory.mktemp("flex"), arch="llama", seed=3, llama3_rope=True)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(params=["kernels", "torch", "flex"])
async def worker(request, memd_factory, checkpoint):
    # inferd's CPU kernels (decode rows attend over the pages; norms, RoPE and the K/V store as one op each),
    # torch's ops alone (decode rows attend over a gathered copy), as where no kernel builds, or decode rows
    # reading the pages through flex attention, as on a GPU (here compiled for the CPU).
    attention, fused = {"kernels": ("paged", True), "torch": ("gather", False), "flex": ("flex", False)}[request.param]
    config = read_config(checkpoint)
    page = BS * config.bytes_per_token
    memd = await memd_factory("--device", "cpu", "--pool-bytes", str(512 * page), "--block-bytes", str(page))
    client = await MemdClient.attach(memd.address, model=checkpoint.name, block_size=BS,
                                     bytes_per_token=config.bytes_per_token)
    model = PagedDecoder(config, load_weights(checkpoint, config.dtype),
                         client.pool.view(config.dtype, config.page_shape(BS)), attention=attention, fused=fused)
    assert (model.attention, model.fused) == (attention, fused)
    yield client, model
    await client.close()


def ref_logits(reference, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([tokens])).logits[0, -1].float()


async def generate_and_compare(client, model, reference, prompts: list[list[int]]) -> None:
    """Prefill every prompt in one pass, then decode them together, checking each step against transformers."""
    opened = await client.step(*[Open(p, reserve=DECODE_STEPS) for p in prompts])
    tables = [r.block_ids for r in opened]
    histories = [list(p) for p in prompts]
    cached = [r.num_cached for r in opened]
    logits = model.forward(build_batch([(p[c:], c, t) for p, c, t in zip(prompts, cached, tables, strict=True)],
                                       BS))
    await client.step(*[Extend(r.seq_id, commit_to=len(p)) for r, p in zip(opened, prompts, strict=True)])
    for step in range(DECODE_STEPS + 1):
        for i, history in enumerate(histories):
            expected = ref_logits(reference, history)
            torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=1e-4,
                                       msg=lambda m, i=i, step=step: f"sequence {i} after {step} decode steps: {m}")
            assert int(logits[i].argmax()) == int(expected.argmax())
        if step == DECODE_STEPS:
            break
        chosen = logits.argmax(-1).tolist()
        batch = build_batch([([tok], len(h), t) for tok, h, t in zip(chosen, histories, tables, strict=True)], BS)
        for history, tok in zip(histories, chosen, strict=True):
            history.append(tok)
        logits = model.forward(batch)


async def test_one_sequence_matches_transformers(worker, reference):
    client, model = worker
    await generate_and_compare(client, model, reference, [[11, 42, 7, 300, 5, 9, 81, 2, 64, 33, 12]])


async def test_a_batch_of_mixed_lengths_matches_transformers(worker, reference):
    client, model = worker
    rng = random.Random(5)
    lengths = [1, 3, 4, 5, 9, 16, 23, 37]                 # within a block, on boundaries, across many
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    await generate_and_compare(client, model, reference, prompts)


async def test_a_pass_mixing_decode_rows_and_prompt_chunks_matches_transformers(worker, reference):
    # Chunked prefill: sequences decode while another's prompt goes in a chunk at a time, after its cached part.
    client, model = worker
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 13, 14, 5)]
    opened = await client.step(*[Open(p, reserve=4) for p in prompts])
    tables = [r.block_ids for r in opened]
    first = model.forward(build_batch([(prompts[0], 0, tables[0]), (prompts[1][:6], 0, tables[1]),
                                       (prompts[2], 0, tables[2])], BS))
    decoded = [int(first[0].argmax()), int(first[2].argmax())]
    # Decode rows between and after chunks: a chunk after cached tokens, and a whole fresh prompt.
    batch = build_batch([([decoded[0]], 9, tables[0]), (prompts[1][6:], 6, tables[1]), ([decoded[1]], 14, tables[2]),
                         (prompts[3], 0, tables[3])], BS)
    layout = model._attention_layout(batch)
    rows = torch.arange(len(batch.token_ids))
    covered = torch.cat([rows[group.rows] for group in layout.groups])
    assert torch.equal(covered.sort().values, rows)          # each new token a query once: none padded
    logits = model.forward(batch)
    for row, history in enumerate([prompts[0] + decoded[:1], prompts[1], prompts[2] + decoded[1:], prompts[3]]):
        expected = ref_logits(reference, history)
        torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=1e-4,
                                   msg=lambda m, row=row: f"row {row}: {m}")


async def test_decode_steps_run_as_traced_graphs_with_the_eager_results(worker, checkpoint):
    client, model = worker
    config = read_config(checkpoint)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (2, 7, 13, 30)]
    opened = await client.step(*[Open(p, reserve=8) for p in prompts])
    logits = model.forward(build_batch([(p, 0, r.block_ids) for p, r in zip(prompts, opened, strict=True)], BS))
    # The eager decoder on a copy of the pages: what each writes is compared too, not only what each reads.
    eager = PagedDecoder(config, load_weights(checkpoint, config.dtype), model.kv.clone(), traced=False,
                         attention=model.attention, fused=model.fused)
    histories = [list(p) for p in prompts]
    # Decode rows through flex attention, one sequence or several, run as one graph of their own.
    decode_graphs = ["pages"] if model.attention == "flex" else ["batch", "single"]
    # The first step has one row: through flex attention, its graph then takes more rows (a K/V store traced
    # on one token, as a setitem, wrote through a fixed view of that one token).
    for step in range(6):                      # one graph for every batch size and context length
        rows = range(len(prompts)) if step % 2 else range(1, 2 + step // 2)
        chosen = logits.argmax(-1).tolist()    # a row for every sequence
        batch = build_batch([([chosen[i]], len(histories[i]), opened[i].block_ids) for i in rows], BS)
        logits = model.forward(batch)
        assert torch.equal(logits, eager.forward(batch))
        assert set(model.traced_graphs) <= set(decode_graphs) and eager.traced_graphs == []
        for i in rows:
            histories[i].append(chosen[i])
        if len(rows) != len(prompts):          # a row for every sequence again: their newest tokens once more
            again = build_batch([(h[-1:], len(h) - 1, r.block_ids) for h, r in zip(histories, opened, strict=True)],
                                BS)
            logits = model.forward(again)
            eager.forward(again)
    for i in (3, 0):                           # one sequence: its own graph, keys cut to its length
        batch = build_batch([([7], len(histories[i]), opened[i].block_ids)], BS)
        assert torch.equal(model.forward(batch), eager.forward(batch))
        histories[i].append(7)
    assert model.traced_graphs == decode_graphs
    assert torch.equal(model.kv, eager.kv)


async def test_one_sequences_prompts_and_chunks_run_as_traced_graphs_with_the_eager_results(worker, checkpoint):
    client, model = worker
    config = read_config(checkpoint)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 17, 2)]
    opened = await client.step(*[Open(p, reserve=16) for p in prompts])
    eager = PagedDecoder(config, load_weights(checkpoint, config.dtype), model.kv.clone(), traced=False,
                         attention=model.attention, fused=model.fused)
    for prompt, seq in zip(prompts, opened, strict=True):        # each alone: one graph for every length
        batch = build_batch([(prompt, 0, seq.block_ids)], BS)
        assert torch.equal(model.forward(batch), eager.forward(batch))
    assert model.traced_graphs == ["prompt"]
    for prompt, seq in zip(prompts, opened, strict=True):        # then more tokens after the cached ones
        more = [rng.randrange(3, 500) for _ in range(len(prompt) % 5 + 2)]
        batch = build_batch([(more, len(prompt), seq.block_ids)], BS)
        assert torch.equal(model.forward(batch), eager.forward(batch))
    assert model.traced_graphs == ["chunk", "prompt"] and eager.traced_graphs == []
    assert torch.equal(model.kv, eager.kv)


def test_a_warmed_up_decoder_has_every_kind_traced_on_scratch_pages_with_the_eager_results(checkpoint):
    # inferd warms up before it says it is ready: no request pays for a trace, and the pool is not written
    config = read_config(checkpoint)
    weights = load_weights(checkpoint, config.dtype)
    pool = torch.randn(16, *config.page_shape(BS))
    model = PagedDecoder(config, weights, pool.clone())
    assert model.warm_up() == ["batch", "chunk", "prompt", "single"]
    assert torch.equal(model.kv, pool)
    eager = PagedDecoder(config, weights, pool.clone(), traced=False, attention=model.attention, fused=model.fused)
    for seqs in ([([5, 6, 7], 0, [0])], [([8, 9], 3, [0, 1])], [([10], 5, [0, 1])],
                 [([11], 6, [0, 1]), ([12], 2, [2])]):
        batch = build_batch(seqs, BS)
        assert torch.equal(model.forward(batch), eager.forward(batch))
    assert torch.equal(model.kv, eager.kv)


def test_a_decoder_with_traced_graphs_goes_with_its_last_reference(checkpoint):
    # torch keeps every traced function for the process's life: none may hold a decoder, its weights or pool.
    config = read_config(checkpoint)
    model = PagedDecoder(config, load_weights(checkpoint, config.dtype), torch.zeros(16, *config.page_shape(BS)))
    model.forward(build_batch([([5], 3, [0]), ([6], 5, [1, 2])], BS))
    model.forward(build_batch([([5], 4, [0, 3])], BS))
    assert model.traced_graphs == ["batch", "single"]
    gone = [weakref.ref(model), weakref.ref(model.layers[0][1]), weakref.ref(model.kv)]
    del model
    assert [ref() for ref in gone] == [None, None, None]


def test_a_decode_graph_runs_to_its_end_while_another_thread_holds_the_gil(checkpoint, monkeypatch):
    # inferd's forward thread runs the graph while its event loop runs Python. torch takes the GIL to let go
    # of a tensor Python can see: were any input let go inside the graph, the step would stop there until
    # the loop gave the GIL up. Here the test's thread keeps it (no forced switch for a minute) and watches
    # the pool, in Python, for the last layer's V of the step's new token.
    config = read_config(checkpoint)
    pool = torch.zeros(16, *config.page_shape(BS))
    model = PagedDecoder(config, load_weights(checkpoint, config.dtype), pool)
    model.forward(build_batch([([5], 2, [0]), ([6], 5, [1, 2])], BS))          # traced on its first step
    entering = threading.Event()
    run = PassGraphs.run

    def announced(graphs: PassGraphs, *args: object) -> torch.Tensor:
        entering.set()                          # nothing from here to the graph lets the GIL go
        return run(graphs, *args)

    monkeypatch.setattr(PassGraphs, "run", announced)
    new_v = pool.numpy()[0, config.num_layers - 1, 1, 3]       # token 3 of the first sequence: block 0, slot 3
    assert not new_v.any()
    step = threading.Thread(target=model.forward, args=(build_batch([([7], 3, [0]), ([8], 6, [1, 2])], BS),))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        step.start()
        entering.wait()                          # back with the GIL once the graph has let it go
        deadline, written = time.perf_counter() + 20.0, False
        while not written and time.perf_counter() < deadline:
            written = bool(new_v.any())          # numpy, on a few values: the GIL stays here
    finally:
        sys.setswitchinterval(switch)
        step.join()
    assert written, "the decode graph stopped for the GIL before its last layer"
    assert model.traced_graphs == ["batch"]


async def test_a_cached_prefix_is_reused_not_recomputed(worker, reference):
    client, model = worker
    system = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]       # three full blocks and one token
    first, = await client.step(Open(system + [40, 41], reserve=1))
    model.forward(build_batch([(system + [40, 41], 0, first.block_ids)], BS))
    await client.step(Extend(first.seq_id, commit_to=15))

    prompt = system + [90, 91, 92]
    second, = await client.step(Open(prompt, reserve=DECODE_STEPS))
    assert second.num_cached == 12 and second.block_ids[:3] == first.block_ids[:3]
    logits = model.forward(build_batch([(prompt[12:], 12, second.block_ids)], BS))   # only 4 new tokens
    torch.testing.assert_close(logits[0], ref_logits(reference, prompt), atol=ATOL, rtol=1e-4)


def test_unsupported_checkpoints_are_refused_clearly(tmp_path, checkpoint):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(CheckpointError, match=r"unsupported architecture .*GPT2LMHeadModel"):
        read_config(tmp_path)
    with pytest.raises(CheckpointError, match="no such file"):
        read_config(tmp_path / "missing")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_weights(tmp_path, torch.float32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_half_precision_checkpoints_run_on_the_pool(memd_factory, tmp_path, dtype):
    directory = make_tiny_model(tmp_path / dtype, arch="llama", seed=3, dtype=dtype)
    config = read_config(directory)
    assert config.dtype == getattr(torch, dtype) and config.bytes_per_token == 2 * 2 * 2 * 16 * 2
    page = BS * config.bytes_per_token
    memd = await memd_factory("--device", "cpu", "--pool-bytes", str(64 * page), "--block-bytes", str(page))
    async with await MemdClient.attach(memd.address, model=dtype, block_size=BS,
                                       bytes_per_token=config.bytes_per_token) as client:
        model = PagedDecoder(config, load_weights(directory, config.dtype),
                             client.pool.view(config.dtype, config.page_shape(BS)))
        prompt = [11, 42, 7, 300, 5, 9, 81, 2, 64]
        seq, = await client.step(Open(prompt, reserve=1))
        logits = model.forward(build_batch([(prompt, 0, seq.block_ids)], BS))
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=getattr(torch, dtype)).eval()
    expected = ref_logits(reference, prompt)
    torch.testing.assert_close(logits[0], expected, atol=0.25, rtol=0.05)    # half precision: ~3 digits


def test_a_sliding_window_caps_the_positions_served(tmp_path):
    directory = make_tiny_model(tmp_path / "mistral", arch="mistral", seed=1)
    config_path = directory / "config.json"
    config_path.write_text(config_path.read_text().replace('"sliding_window": null', '"sliding_window": 1024'))
    assert read_config(directory).max_position == 1024


@pytest.mark.processes                         # torch's compiler builds the kernel in processes of its own
def test_flex_decode_compiles_ahead_every_batch_size_a_step_pads_to(flex_checkpoint):
    # inferd serve compiles them at attach: no request waits seconds for a compile on its first step.
    from torch._dynamo.utils import counters
    config = read_config(flex_checkpoint)
    model = PagedDecoder(config, load_weights(flex_checkpoint, config.dtype), torch.zeros(16, *config.page_shape(BS)),
                         attention="flex")
    assert model.compile_ahead(3) == [1, 2, 4]
    compiled = counters["stats"]["unique_graphs"]
    for rows in (3, 1, 4, 2):                  # each pads to a size compiled ahead
        model.forward(build_batch([([5], 2 + i, [2 * i, 2 * i + 1]) for i in range(rows)], BS))
    assert counters["stats"]["unique_graphs"] == compiled > 0
    # The steps ran as one traced graph, which torch keeps for the process's life: it holds no decoder.
    assert model.traced_graphs == ["pages"]
    gone = [weakref.ref(model), weakref.ref(model._flex), weakref.ref(model.kv)]
    del model
    assert [ref() for ref in gone] == [None, None, None]


def test_a_flex_decoder_recomputing_into_other_pages_attends_over_a_copy_of_those(flex_checkpoint):
    # The reuse check recomputes a prefix into scratch pages (inferd.reuse_check): flex's views span the pool,
    # so a step on other pages, one token included, attends over a gathered copy of them, as the gather decoder.
    config = read_config(flex_checkpoint)
    weights = load_weights(flex_checkpoint, config.dtype)
    flex = PagedDecoder(config, weights, torch.zeros(16, *config.page_shape(BS)), attention="flex")
    gather = PagedDecoder(config, weights, torch.zeros(16, *config.page_shape(BS)), attention="gather")
    scratch = [torch.zeros(3, *config.page_shape(BS)) for _ in range(2)]
    prompt = [11, 42, 7, 300, 5, 9]
    for model, pages in zip((flex, gather), scratch, strict=True):
        model.forward(build_batch([(prompt, 0, [0, 1])], BS), kv=pages)
    for tokens, cached in (([8], 6), ([3], 7), ([4, 6], 8)):         # one token after cached ones, then two
        batch = build_batch([(tokens, cached, [0, 1, 2])], BS)
        torch.testing.assert_close(flex.forward(batch, kv=scratch[0]), gather.forward(batch, kv=scratch[1]))
    assert torch.equal(scratch[0], scratch[1]) and flex.traced_graphs == gather.traced_graphs
