"""Decode attention on a GPU pool: torch's flex attention reading K/V where they lie in memd's pages.

On a GPU, decode rows attended over a copy: each step gathered every
sequence's pages into one tensor per layer for scaled_dot_product_attention,
reading the whole context twice and writing it once. Here flex attention's
decode kernel (Triton, built by torch.compile) reads the keys and values from
the pages themselves, told which pages each sequence owns by a BlockMask.

The pool is [blocks, layers, K/V, block_size, kv_heads, head_dim]: one
layer's keys are not one run of rows. But seen as rows of [kv_heads,
head_dim], the whole pool is one run, and from a layer's first key row every
block's keys for that layer lie `2 * layers * block_size` rows apart, its
values `block_size` rows after them. So each layer's K and V are two strided
views of the same memory, of the same length for every layer: page `b` is
tile `b * 2 * layers` of both, whichever the layer, and one BlockMask serves
every layer of a step. Its mask keeps, in each sequence's last page, the
slots its context fills; every other page of the sequence is full.

A decode step through flex runs as a traced graph like inferd's other
passes (inferd.layer_stack.PassGraphs: an eager pass on the forward thread
takes the GIL back from the event loop at every op):
`torch.ops.kvpool.flex_decode` is an op of torch's dispatcher whose Python
body calls the compiled kernel with the mask the step's layout made, so the
graph keeps one node per layer for it and runs the rest without Python.

Compiled for the CPU (inferd's tests; on a CPU pool inferd's own kernel
serves), torch's lowering wants the page lists as wide as the whole pool's
keys and its kernel's time grows with them, with the pool's size rather than
the context's; and run on another count of torch threads than it was
compiled at, it runs many times slower. Its GPU kernels take lists
as wide as one sequence's pages, and no CPU threads.

Compiling costs seconds per batch size, so a step's rows are padded to a
power of two (the padding rows read one key of block 0 and are dropped), the
page lists to one width, and a batch size's mask buffers are kept and
refilled in place: a mask of the same shape and the same closure is the same
graph, compiled once per batch size and process.
"""

from __future__ import annotations

import functools
import gc
import itertools
import weakref
from typing import Any

import structlog
import torch

log = structlog.get_logger("inferd.flex_decode")

MAX_BATCH_BUCKETS = 16                      # compiled graphs per decoder: batch sizes 1, 2, 4 ... 2**15
MAX_ROWS = 1 << (MAX_BATCH_BUCKETS - 1)
# Each layer's K/V views span the whole pool. Past 2**31 elements the kernel indexes with int64, and with
# page lists in int32 torch's flex decode template mixes int64 and int32 in one expression, which Triton
# refuses (seen on an H200 with torch 2.11 and a 16 GiB bfloat16 pool; torch 2.13's template reads the same).
# Such pools get their page lists in int64 (FlexDecode's `wide`), which has yet to run on a GPU: until it
# has, `unavailable` refuses them.
MAX_POOL_ELEMENTS = 1 << 31


def _power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def _bucket(rows: int) -> int:
    """The batch size a step of `rows` decode rows is padded to: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


def unavailable(device: torch.device, block_size: int, num_heads: int, kv_heads: int, head_dim: int, *,
                pool_elements: int) -> str | None:
    """Why flex attention's decode kernel cannot serve this pool and model, or None where it can: a CUDA GPU
    with Triton in this torch; a pool of fewer than 2**31 elements (MAX_POOL_ELEMENTS); pages of a power of
    two of at least 16 tokens (a page is one of the kernel's tiles); a whole number of query heads per KV
    head; heads of at least 16."""
    if device.type != "cuda":
        return f"flex attention reads a GPU pool; this one is on {device}"
    if pool_elements >= MAX_POOL_ELEMENTS:
        return (f"a pool of {pool_elements / 2**30:.1f}Gi elements: torch's flex decode kernel (torch "
                f"{torch.__version__}) failed to compile with the 64-bit offsets a pool of 2Gi elements or more "
                "needs, and page lists in int64 have yet to run on a GPU; take --attention gather, or a smaller "
                "pool")
    if block_size < 16 or not _power_of_two(block_size):
        return f"pages must be a power of two of at least 16 tokens, not {block_size}"
    if num_heads % kv_heads:
        return f"{num_heads} query heads over {kv_heads} KV heads: not a whole number of query heads each"
    if head_dim < 16:
        return f"heads of {head_dim}: torch's kernel wants at least 16"
    try:
        import triton  # noqa: F401
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return "this torch has no flex attention, or no Triton"
    return None


_decoders: dict[int, weakref.ref[FlexDecode]] = {}     # by id: a traced graph names its decoder's by number
_ids = itertools.count(1)


@torch.library.custom_op("kvpool::flex_decode", mutates_args=())
def flex_decode(q: torch.Tensor, cache: torch.Tensor, decoder: int, scale: float) -> torch.Tensor:
    """Decoder number `decoder`'s `attend` of its step's rows, with the mask its `mask` made last."""
    flex = _decoders[decoder]()
    if flex is None or flex.current is None:
        raise RuntimeError(f"flex decode: decoder {decoder} is gone, or made no mask for this step")
    return flex.attend(q, cache, flex.current, scale)


@functools.cache
def _compiled() -> Any:
    from torch.nn.attention.flex_attention import flex_attention
    # One graph per batch size (the module docstring), several decoders in one process: above dynamo's default of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * MAX_BATCH_BUCKETS)
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


class FlexDecode:
    """One decoder's decode attention through flex attention, over its pool `pages`."""

    def __init__(self, pages: torch.Tensor, num_heads: int, max_context: int, *, wide: bool | None = None) -> None:
        """`pages`: [blocks, layers, 2, block_size, kv_heads, head_dim]; `max_context`: the most tokens one
        sequence holds, which sets the width of the page lists.

        `wide`: the page lists in int64, not int32 (default: where the pool has 2**31 elements or more).
        The GPU kernel bounds its walk over a row's pages by both the lists' count and its own program ids,
        which it holds in int64 once its offsets are 64-bit: lists in int32 then made it mix the two types,
        which Triton refuses (MAX_POOL_ELEMENTS); lists in int64 keep them one type."""
        blocks, layers, _, self.block_size, self.kv_heads, self.head_dim = pages.shape
        self.num_heads = num_heads
        # Query heads per KV head, and as the kernel sees them: padded to a power of two with zero queries,
        # whose outputs are dropped. torch's lowering takes its decode kernel only for a power of two (else
        # its general kernel, whose tiles no 16-token page fills): Qwen2's 7 and 6 become 8.
        self.group = num_heads // self.kv_heads
        self.padded_group = 1 << (self.group - 1).bit_length()
        self.device = pages.device
        wide = pages.numel() >= MAX_POOL_ELEMENTS if wide is None else wide
        self.index_dtype = torch.int64 if wide else torch.int32
        self.tile = 2 * layers                                   # tiles (block_size rows) from one page to the next
        self.rows = (blocks - 1) * self.tile * self.block_size + self.block_size   # K/V rows every layer's views span
        width = -(-max_context // self.block_size)
        # torch's CPU lowering wants the page lists as wide as the keys and a list of full pages; its GPU
        # kernels take any width, and with no list of full pages they split each sequence's pages over the SMs.
        self.cpu = self.device.type == "cpu"
        self.width = -(-self.rows // self.block_size) if self.cpu else width
        # The GPU kernel's grid has a row of blocks per (sequence, KV head), and a grid's rows are at most 65,535.
        self.max_rows = MAX_ROWS if self.cpu else min(MAX_ROWS, 1 << ((65_535 // self.kv_heads).bit_length() - 1))
        self._masks: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self.current: Any = None                               # the mask `mask` made last: the step's
        self.id = next(_ids)                                    # for torch.ops.kvpool.flex_decode
        _decoders[self.id] = weakref.ref(self)
        weakref.finalize(self, _decoders.pop, self.id, None)
        # Each row's last page and how many of its slots hold context, read by every mask's closure.
        self._last_block = torch.zeros(MAX_ROWS, dtype=torch.long, device=self.device)
        self._last_fill = torch.ones(MAX_ROWS, dtype=torch.long, device=self.device)

    # Every method in inference mode, as the passes run: in another grad mode each size would compile again,
    # and the mask's buffers, made in inference mode, could not be refilled outside it.
    @torch.inference_mode()
    def mask(self, block_tables: torch.Tensor, context_lens: torch.Tensor) -> Any:
        """The BlockMask of a decode step: row i reads the first ceil(context_lens[i] / block_size) pages of
        block_tables[i], all of each but the last, of which the first slots its context fills."""
        rows = block_tables.shape[0]
        bucket = _bucket(rows)
        if bucket > self.max_rows:
            raise ValueError(f"a decode step of {rows} sequences: flex decode takes at most {self.max_rows} "
                             "(lower --max-num-seqs)")
        if block_tables.shape[1] > self.width:
            raise ValueError(f"a sequence holds {block_tables.shape[1]} pages, more than the {self.width} "
                             "this decoder's context allows")
        block_mask, num_pages, page_tiles = self._mask_of(bucket)
        pages = -(-context_lens // self.block_size)
        num_pages[:rows, 0, 0] = pages.to(self.index_dtype)
        num_pages[rows:] = 1
        page_tiles[:rows, 0, 0, :block_tables.shape[1]] = (block_tables * self.tile).to(self.index_dtype)
        page_tiles[rows:, 0, 0, 0] = 0
        last = block_tables.gather(1, (pages - 1).clamp(min=0)[:, None])[:, 0]
        self._last_block[:rows] = last
        self._last_fill[:rows] = context_lens - (pages - 1) * self.block_size
        self._last_block[rows:bucket] = 0
        self._last_fill[rows:bucket] = 1
        self.current = block_mask
        return block_mask

    @torch.inference_mode()
    def attend(self, q: torch.Tensor, cache: torch.Tensor, block_mask: Any, scale: float) -> torch.Tensor:
        """[B, heads * head_dim]: each row's one query `q` [B, heads, head_dim] over its pages of `cache`, one
        layer's view of the pool ([blocks, 2, block_size, kv_heads, head_dim], `pages[:, layer]`)."""
        rows, bucket = q.shape[0], block_mask.kv_num_blocks.shape[0]
        kv_heads, group, padded, dim = self.kv_heads, self.group, self.padded_group, self.head_dim
        queries = q.new_zeros(bucket, kv_heads * padded, 1, dim)
        queries.view(bucket, kv_heads, padded, dim)[:rows, :, :group] = q.view(rows, kv_heads, group, dim)
        shape = (1, self.kv_heads, self.rows, self.head_dim)
        stride = (0, self.head_dim, self.kv_heads * self.head_dim, 1)
        start = cache.storage_offset()
        keys = cache.as_strided(shape, stride, start)
        values = cache.as_strided(shape, stride, start + self.block_size * self.kv_heads * self.head_dim)
        out = _compiled()(queries, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)
        return out.reshape(bucket, kv_heads, padded, dim)[:rows, :, :group].reshape(rows, self.num_heads * dim)

    @torch.inference_mode()
    def compile_ahead(self, rows: int, pages: torch.Tensor) -> list[int]:
        """Compile every batch size a step of up to `rows` decode rows pads to, before serving: on its first
        step each took seconds, which the requests of that step waited. Reads one key of block 0 of `pages`
        (this decoder's pool), writes nothing; returns the batch sizes."""
        buckets = [1 << i for i in range(_bucket(rows).bit_length())]
        for bucket in buckets:
            tables = torch.zeros(bucket, 1, dtype=torch.long, device=self.device)
            mask = self.mask(tables, torch.ones(bucket, dtype=torch.long, device=self.device))
            q = torch.zeros(bucket, self.num_heads, self.head_dim, dtype=pages.dtype, device=self.device)
            self.attend(q, pages[:, 0], mask, self.head_dim ** -0.5)
        # torch's compiler leaves reference cycles that hold its example inputs, views of the pool: collected
        # now, the pool goes with its decoder rather than at some later collection.
        gc.collect()
        return buckets

    def _mask_of(self, bucket: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """A batch size's BlockMask and the buffers it reads, made once and refilled by `mask`."""
        if bucket in self._masks:
            return self._masks[bucket]
        from torch.nn.attention.flex_attention import BlockMask
        last_block, last_fill = self._last_block, self._last_fill
        page_rows, block_size = self.tile * self.block_size, self.block_size

        def in_context(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return ((kv_idx // page_rows) != last_block[b]) | ((kv_idx % block_size) < last_fill[b])

        num_pages = torch.ones(bucket, 1, 1, dtype=self.index_dtype, device=self.device)
        page_tiles = torch.zeros(bucket, 1, 1, self.width, dtype=self.index_dtype, device=self.device)
        full = {}
        if self.cpu:
            full = {"full_kv_num_blocks": torch.zeros_like(num_pages), "full_kv_indices": torch.zeros_like(page_tiles)}
        block_mask = BlockMask.from_kv_blocks(num_pages, page_tiles, BLOCK_SIZE=(128, self.block_size),
                                              mask_mod=in_context, seq_lengths=(1, self.rows),
                                              compute_q_blocks=False, **full)
        log.info("flex decode: a new batch size compiles on its first step", rows=bucket)
        self._masks[bucket] = (block_mask, num_pages, page_tiles)
        return self._masks[bucket]
