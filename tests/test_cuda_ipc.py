"""The CUDA backend: memd's pool on a GPU, opened by other processes through CUDA IPC.

Skipped without a GPU; run it wherever one is present. Beyond raw pages, the
paged decoder runs end to end on the GPU (memd --device cuda:0, inferd workers
on its pool) and is checked against `transformers` on the same GPU and weights.

How a paged output is checked: teacher-forced. The reference computes its
logits at every position of prompt + output in one pass; every token inferd
chose must be the reference's argmax there, or within TIE of it. Two fp32
kernels may order a near-tie differently, which an exact comparison of free-
running greedy decodes would report as a bug from then on; a real bug (a wrong
page, a stale swap-in) is off by whole units. Exact matches are printed (-rA).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from shared.rpc import inferd_pb2 as pb
from shared.rpc import inferd_pb2_grpc as pb_grpc
from tests.attention_reference import attention_over_a_copy

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda:0"
BS = 16          # tokens per block (memd --block-size, inferd's default)
TIE = 1e-2       # fp32 kernels differ by ~1e-5; this model's top-2 logits ~0.5 apart (spread ~1.6)
PROMPTS = [[11], [11, 42, 7, 300, 5], list(range(20, 36)), list(range(40, 57)),
           [(i * 37 + 5) % 500 + 3 for i in range(41)]]       # one token; within, on and across block boundaries


async def test_two_processes_share_a_gpu_pool(memd_factory, spawn_worker):
    memd = await memd_factory("--device", "cuda:0", "--pool-bytes", "64MiB", "--block-bytes", "64KiB")
    writer = await spawn_worker(memd.address)
    reader = await spawn_worker(memd.address)
    opened, = await writer.step({"kind": "open", "token_ids": list(range(40)), "session_id": "gpu"})
    written = [await writer.call("write", block=b, seed=i) for i, b in enumerate(opened["block_ids"])]
    await writer.step({"kind": "park", "seq_id": opened["seq_id"], "commit_to": 40})

    resumed, = await reader.step({"kind": "resume", "session_id": "gpu"})
    for block, expected in zip(resumed["block_ids"], written, strict=True):
        assert (await reader.call("read", block=block))["digest"] == expected["digest"]

    await reader.step({"kind": "free", "seq_id": resumed["seq_id"]})
    again, = await writer.step({"kind": "open", "token_ids": [5, 6, 7]})
    assert (await writer.call("read", block=again["block_ids"][0]))["zero"]
    async with memd.admin() as admin:
        assert (await admin.stats()).backend == "cuda"
        assert (await admin.check()).ok


# ---- the paged decoder on the GPU, end to end ------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_reference(checkpoint: Path) -> Any:
    """`transformers` on the same weights, fp32, on the same GPU as the pool."""
    transformers = pytest.importorskip("transformers")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    except TypeError:              # transformers < 4.56 knows only torch_dtype
        model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), torch_dtype=torch.float32)
    return model.to(DEVICE).eval()


def reference_check(reference: Any, context: list[int], output: list[int]) -> list[str]:
    """Each output token is the reference's greedy choice after context + the output before it (up to TIE).

    Returns a note for each near-tie taken the other way; fails on anything further off.
    """
    with torch.inference_mode():
        ids = torch.tensor([context + output[:-1]], device=DEVICE)
        logits = reference(ids).logits[0, len(context) - 1:].float().cpu()
    notes = []
    for i, (row, token) in enumerate(zip(logits, output, strict=True)):
        best = int(row.argmax())
        if best != token:
            gap = float(row[best] - row[token])
            assert gap <= TIE, (f"output token {i} after {len(context)} tokens: inferd chose {token}, the reference "
                                f"{best}, {gap:.3g} apart (logit {float(row[token]):.4f} vs {float(row[best]):.4f})")
            notes.append(f"token {i}: near-tie {token} vs {best} ({gap:.1e} apart)")
    return notes


def greedy_reference(reference: Any, context: list[int], n: int) -> list[int]:
    """The reference's own free-running greedy decode (printed beside inferd's, not asserted)."""
    tokens, out = list(context), []
    with torch.inference_mode():
        for _ in range(n):
            nxt = int(reference(torch.tensor([tokens], device=DEVICE)).logits[0, -1].argmax())
            tokens.append(nxt)
            out.append(nxt)
    return out


async def generate(address: str, prompt_ids: list[int], max_tokens: int, session: str = "",
                   **params: Any) -> tuple[list[int], Any, str]:
    """Greedy (unless `params` say otherwise) with ignore_eos: (token ids, usage, finish reason)."""
    tokens, usage, finish = [], None, ""
    async with grpc.aio.insecure_channel(address) as channel:
        async for reply in pb_grpc.InferdStub(channel).Generate(
                pb.GenerateRequest(prompt_ids=prompt_ids, max_tokens=max_tokens, ignore_eos=True, session_id=session,
                                   **params), timeout=120):
            tokens += reply.token_ids
            if reply.finish_reason:
                usage, finish = reply.usage, reply.finish_reason
    return tokens, usage, finish


async def gpu_memd(memd_factory, checkpoint: Path, *args: str, pool: str = "8MiB", name: str = "memd"):
    memd = await memd_factory("--device", DEVICE, "--pool-bytes", pool, "--model", str(checkpoint), "--block-size",
                              str(BS), *args, name=name)
    async with memd.admin() as admin:
        stats = await admin.stats()
    assert stats.backend == "cuda", stats.backend
    return memd


async def assert_settled(memd, *, parked: int) -> Any:
    async with memd.admin() as admin:
        stats = await admin.stats()
        assert stats.sequences["running"] == 0 and stats.sequences["parked"] == parked
        assert (await admin.check()).ok
    return stats


@pytest.mark.timeout(150)
@pytest.mark.parametrize("attention", ["gather", "flex"])
async def test_generate_on_a_gpu_pool_matches_transformers_on_the_gpu(memd_factory, inferd_factory, checkpoint,
                                                                     gpu_reference, attention):
    # Decode rows over a gathered copy (inferd's default on a GPU), or reading the pages through flex attention.
    memd = await gpu_memd(memd_factory, checkpoint)
    inferd = await inferd_factory(checkpoint, memd.address, "--attention", attention)
    alone = await generate(inferd.address, PROMPTS[1], 24)                        # one sequence
    together = await asyncio.gather(*(generate(inferd.address, p, 24) for p in PROMPTS))   # a batch, mixed lengths
    notes = {}
    for prompt, (tokens, usage, finish) in zip([PROMPTS[1], *PROMPTS], [alone, *together], strict=True):
        assert finish == "length" and len(tokens) == 24 and usage.completion_tokens == 24
        assert usage.prompt_tokens == len(prompt)
        notes[len(prompt)] = reference_check(gpu_reference, prompt, tokens)
        exact = tokens == greedy_reference(gpu_reference, prompt, 24)
        print(f"prompt of {len(prompt)}: exact greedy match {exact}; near-ties {notes[len(prompt)]}")
    # Batched kernels may order a near-tie differently from one sequence's: reported, checked above.
    print(f"prompt of {len(PROMPTS[1])}: alone == in the batch: {alone[0] == together[1][0]}")
    stats = await assert_settled(memd, parked=0)
    assert stats.used_blocks == 0


@pytest.mark.timeout(150)
async def test_a_second_turn_on_another_gpu_worker_reuses_the_parked_blocks(memd_factory, inferd_factory, checkpoint,
                                                                           gpu_reference):
    memd = await gpu_memd(memd_factory, checkpoint)
    first = await inferd_factory(checkpoint, memd.address, name="inferd-a")
    second = await inferd_factory(checkpoint, memd.address, name="inferd-b")
    turn1_prompt, turn2_prompt = PROMPTS[4], [80, 90, 100, 110, 120]
    out1, usage1, _ = await generate(first.address, turn1_prompt, 16, session="roam")
    assert usage1.cached_tokens == 0
    out2, usage2, finish2 = await generate(second.address, turn2_prompt, 12, session="roam")
    history = turn1_prompt + out1
    assert finish2 == "length" and len(out2) == 12
    assert usage2.cached_tokens == len(history) - 1          # the last sampled token was never computed
    assert usage2.prompt_tokens == len(history) + len(turn2_prompt)
    print("turn 1 near-ties:", reference_check(gpu_reference, turn1_prompt, out1))
    print("turn 2 near-ties:", reference_check(gpu_reference, history + turn2_prompt, out2))
    async with memd.admin() as admin:
        snapshot = await admin.snapshot()
        assert len(snapshot.workers) == 2 and [s.state for s in snapshot.sequences] == ["parked"]
        assert (await admin.check()).ok

    # The same chat on one worker of a memd of its own (no prefix cache shared): the very same tokens.
    solo_memd = await gpu_memd(memd_factory, checkpoint, name="memd-solo")
    solo = await inferd_factory(checkpoint, solo_memd.address, name="inferd-solo")
    solo1, _, _ = await generate(solo.address, turn1_prompt, 16, session="roam")
    solo2, solo_usage2, _ = await generate(solo.address, turn2_prompt, 12, session="roam")
    assert (solo1, solo2) == (out1, out2)
    assert solo_usage2.cached_tokens == usage2.cached_tokens
    await assert_settled(memd, parked=1)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["swap", "drop"])
async def test_a_session_evicted_from_the_gpu_resumes_with_the_same_output(memd_factory, inferd_factory,
                                                                          spawn_worker, checkpoint, gpu_reference,
                                                                          mode):
    # 32 pages of 16 tokens; the session takes 3 or 4 of them, the swap tier (0.3) holds 9.
    memd = await gpu_memd(memd_factory, checkpoint, "--free-watermark", "0", "--lease-timeout", "30",
                          pool="256KiB")
    inferd = await inferd_factory(checkpoint, memd.address)
    turn1_prompt, turn2_prompt = PROMPTS[3], [7, 77, 177, 277]
    out1, _, _ = await generate(inferd.address, turn1_prompt, 24, session="cold")
    async with memd.admin() as admin:
        reply = await admin.evict(session_id="cold", mode=mode)
        assert len(reply.swapped if mode == "swap" else reply.dropped) == 1, reply
        free = (await admin.stats()).free_blocks
    # Another process takes every free page (the session's old ones included), scribbles on it and frees it:
    # what turn 2 finds can only have come back from the swap tier (or been recomputed).
    hog = await spawn_worker(memd.address)
    taken, = await hog.step({"kind": "open", "token_ids": [], "reserve": free * BS})
    assert len(taken["block_ids"]) == free
    for block in taken["block_ids"]:
        await hog.call("write", block=block, seed=1000 + block)
    await hog.step({"kind": "free", "seq_id": taken["seq_id"]})

    out2, usage2, finish2 = await generate(inferd.address, turn2_prompt, 12, session="cold")
    history = turn1_prompt + out1
    assert finish2 == "length" and usage2.prompt_tokens == len(history) + len(turn2_prompt)
    async with memd.admin() as admin:
        counters = dict((await admin.stats()).counters)
    print(f"{mode}: cached_tokens {usage2.cached_tokens} of {usage2.prompt_tokens}; counters {counters}")
    if mode == "swap":
        assert counters["swap_outs"] == 1 and counters["swap_ins"] == 1
        assert usage2.cached_tokens == len(history) - 1          # the K/V came back, nothing recomputed
    else:
        assert counters["drops"] >= 1
    notes = reference_check(gpu_reference, history + turn2_prompt, out2)
    print(f"{mode}: turn 2 near-ties {notes}; exact greedy match "
          f"{out2 == greedy_reference(gpu_reference, history + turn2_prompt, 12)}")
    await assert_settled(memd, parked=1)


@pytest.mark.timeout(150)
async def test_seeded_sampling_on_a_gpu_pool_is_reproducible(memd_factory, inferd_factory, checkpoint):
    memd = await gpu_memd(memd_factory, checkpoint)
    inferd = await inferd_factory(checkpoint, memd.address)
    runs = [await generate(inferd.address, PROMPTS[1], 16, temperature=0.8, top_p=0.9, seed=3) for _ in range(2)]
    (first, _, finish), (again, _, _) = runs
    assert finish == "length" and len(first) == 16
    assert first == again
    await assert_settled(memd, parked=0)


@pytest.mark.timeout(150)
async def test_a_gpu_memd_killed_gives_its_chats_back_dropped_and_they_answer_the_same(memd_factory, inferd_factory,
                                                                                      checkpoint):
    """On cuda the pool dies with memd; the journal does not: sessions come back dropped, and recompute."""
    memd = await gpu_memd(memd_factory, checkpoint)
    inferd = await inferd_factory(checkpoint, memd.address)
    turn1_prompt, turn2_prompt = PROMPTS[4], [80, 90, 100, 110, 120]
    for session in ("chat", "reference"):
        await generate(inferd.address, turn1_prompt, 16, session=session)
    expected, _, _ = await generate(inferd.address, turn2_prompt, 12, session="reference")

    await memd.kill()
    await inferd.log.wait_for("lost memd; reconnecting")
    again = await gpu_memd(memd_factory, checkpoint, "--listen", memd.address)
    recovered = await again.log.wait_for("recovered the sequences of the memd before")
    assert recovered["sequences"] == {"dropped": 2} and recovered["dropped"] == {"pool not reopened": 2}
    await inferd.log.wait_for("attached to memd", nth=2)
    out2, usage2, _ = await generate(inferd.address, turn2_prompt, 12, session="chat")
    assert out2 == expected
    print(f"after the restart: cached_tokens {usage2.cached_tokens} of {usage2.prompt_tokens} (recomputed)")
    await assert_settled(again, parked=1)


def test_gpu_page_checksums_are_the_hosts_and_catch_a_rotten_swap_slot():
    """The device reduction is the same number the host computes, and a swap-in checks what it copied."""
    from memd.memory import CudaMemory
    from memd.page_copier import run_effects
    from memd.page_effects import SwapIn
    from memd.pinned_swap import PinnedSwap
    from shared.page_checksum import word_sums

    pool = CudaMemory(DEVICE, 64, 64 << 10)
    swap = PinnedSwap(pool, 16, 64 << 10)
    pool.pages.copy_(torch.randint(0, 256, pool.pages.shape, dtype=torch.uint8, device=DEVICE))
    pages = [3, 9, 40, 63]
    sums = pool.checksums(pages)
    assert sums == word_sums(pool.pages.cpu(), pages) and all(sums)
    swap.copy_out([(page, slot) for slot, page in enumerate(pages)])
    swap.slots[2, 1000] ^= 0xFF                                      # the third slot rots
    back = [SwapIn([0, 1], [50, 51], sums[:2]), SwapIn([2, 3], [52, 53], sums[2:])]   # two sequences' runs
    assert run_effects(pool, swap, back) == [52]
    assert pool.checksums([50, 51, 53]) == [sums[0], sums[1], sums[3]]


@pytest.mark.parametrize("page_bytes, gather", [(64 << 10, None), (1 << 20, True), (1 << 20, None)])
def test_gpu_swap_moves_scattered_pages_to_scattered_slots_and_back(monkeypatch, page_bytes, gather):
    """Chunk after chunk through a small staging buffer, runs of slots broken everywhere: each page comes back."""
    from memd import pinned_swap
    from memd.memory import CudaMemory

    monkeypatch.setattr(pinned_swap, "STAGING_BYTES", 5 * page_bytes)     # 5 rows: the 37 pages take 8 chunks
    pool = CudaMemory(DEVICE, 96, page_bytes)
    swap = pinned_swap.PinnedSwap(pool, 48, page_bytes, gather=gather)
    pool.pages.copy_(torch.randint(0, 256, pool.pages.shape, dtype=torch.uint8, device=DEVICE))
    pages = [(i * 29) % 96 for i in range(37)]
    slots = [(i * 7) % 48 for i in range(37)][::-1]
    before = pool.pages[pages].clone()
    swap.copy_out(list(zip(pages, slots, strict=True)))
    assert torch.equal(swap.slots[slots], before.cpu())
    back = [95 - p for p in pages]
    pool.pages.zero_()
    swap.copy_in(list(zip(slots, back, strict=True)))
    assert torch.equal(pool.pages[back], before)
    with pytest.raises(IndexError):
        swap.copy_out([(3, 48)])


@pytest.mark.timeout(120)
@pytest.mark.processes                         # torch's compiler builds the kernel in processes of its own
@pytest.mark.parametrize("blocks", [8191, 9000])
def test_flex_decode_reads_pages_across_a_large_pool_as_a_gathered_copy(blocks):
    # One layer's K/V views span the pool: 8191 pages of 2**18 elements are 2**31 less a page (4 GiB), so the
    # kernel's 32-bit offsets reach their end; 9000 pages are past 2**31 elements, which `unavailable` refuses
    # until this passes: the kernel's offsets are 64-bit and the page lists int64 (FlexDecode's `wide`).
    # Pages at both ends of the pool, a sequence whose last page is partly filled, others' pages between.
    from inferd.flex_decode import MAX_POOL_ELEMENTS, FlexDecode, unavailable
    layers, bs, kv_heads, dim, heads = 16, 16, 8, 64, 32
    pages = torch.empty(blocks, layers, 2, bs, kv_heads, dim, dtype=torch.bfloat16, device=DEVICE)
    wide = pages.numel() >= MAX_POOL_ELEMENTS
    assert (unavailable(pages.device, bs, heads, kv_heads, dim, pool_elements=pages.numel()) is None) != wide
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    end = blocks - 1
    tables = torch.tensor([[0, end, blocks // 2], [end - 1, 1, 2], [end - 2, end - 3, end - 4]], device=DEVICE)
    lens = torch.tensor([40, 33, 48], device=DEVICE)
    for b in tables.unique().tolist():
        pages[b].normal_(generator=gen)
    flex = FlexDecode(pages, heads, max_context=4096)
    assert flex.index_dtype == (torch.int64 if wide else torch.int32)
    mask = flex.mask(tables, lens)
    q = torch.randn(3, heads, dim, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    for layer in (0, layers - 1):
        out = flex.attend(q, pages[:, layer], mask, dim ** -0.5)
        for i in range(3):
            ref = attention_over_a_copy(q[i], pages, layer, tables[i], lens[i])
            torch.testing.assert_close(out[i], ref, atol=2e-2, rtol=2e-2)


@pytest.mark.timeout(120)
@pytest.mark.processes                         # torch's compiler builds the kernel in processes of its own
@pytest.mark.parametrize(("heads", "kv_heads"), [(14, 2), (12, 2)])      # Qwen2-0.5B's 7 a KV head, and 6
def test_flex_decode_pads_query_groups_to_the_kernels_power_of_two(heads, kv_heads):
    from inferd.flex_decode import FlexDecode, unavailable
    bs, dim, blocks = 16, 64, 64
    assert unavailable(torch.device(DEVICE), bs, heads, kv_heads, dim, pool_elements=1 << 20) is None
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    pages = torch.randn(blocks, 2, 2, bs, kv_heads, dim, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    tables = torch.tensor([[3, 63, 7], [62, 1, 2], [5, 4, 0]], device=DEVICE)
    lens = torch.tensor([40, 17, 33], device=DEVICE)
    q = torch.randn(3, heads, dim, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    flex = FlexDecode(pages, heads, max_context=256)
    mask = flex.mask(tables, lens)
    for layer in (0, 1):
        out = flex.attend(q, pages[:, layer], mask, dim ** -0.5)
        for i in range(3):
            ref = attention_over_a_copy(q[i], pages, layer, tables[i], lens[i])
            torch.testing.assert_close(out[i], ref, atol=2e-2, rtol=2e-2)
