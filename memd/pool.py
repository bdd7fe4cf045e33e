"""The pages: which are free, who references them, what prefix they cache.

Invariants (`BlockPool.violations` checks them):
- a block is in the free queue exactly when its ref count is 0, and at most once;
- a block carries a content hash exactly when `by_hash` maps that hash to it.

Allocation order: a freed block that caches no prefix goes to the front of the
free queue, a freed block with a content hash to the back. Allocation pops the
front, so worthless blocks are reused first and cached prefixes live longest,
least recently freed evicted first.

Every mutation can be recorded in an undo log: a Step applies its operations
one by one and, if a later one fails, replays the log backwards so that nothing
changed (this is not the on-disk journal of `memd.journal`, which outlives memd).
The free queue is a linked list; the undo log keeps the neighbours a block had
when it left the queue, so undo in reverse order puts it back exactly there,
even if the block re-entered the queue elsewhere in between.

A Step takes and gives back pages in runs (a prompt's blocks, a finished
sequence's, its prefix hits): `allocate_n`, `release_n` and `incref_n` do a
run in one pass, with one undo record and the old values read at C speed
(`itemgetter`), rather than a method call, a branch and an undo record per
block. They leave the pool exactly as the same blocks one by one would.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, compress, repeat
from operator import itemgetter
from typing import Any

from memd.errors import PoolExhausted


def picked(values: list[Any], indices: list[int]) -> tuple[Any, ...]:
    """`values` at `indices`, read at C speed: per-block state is read for runs of thousands of pages (a
    long session's), and a comprehension over them was a third of a decode Step's journaling."""
    if len(indices) > 1:
        return itemgetter(*indices)(values)
    return (values[indices[0]],) if indices else ()


class UndoLog:
    """Undo records of one Step, in memory; `rollback` restores the state before it."""

    __slots__ = ("_undo",)

    def __init__(self) -> None:
        self._undo: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def record(self, fn: Callable[..., Any], *args: Any) -> None:
        self._undo.append((fn, args))

    def rollback(self) -> None:
        while self._undo:
            fn, args = self._undo.pop()
            fn(*args)


class FreeQueue:
    """Doubly linked list of block ids in two int arrays; every operation is O(1).

    A block out of the queue has previous -1: membership costs no third array to keep up to date.
    """

    __slots__ = ("_end", "_len", "_next", "_prev", "watches")

    def __init__(self, num_blocks: int) -> None:
        end = num_blocks                          # the sentinel node
        self._end = end
        # int32 arrays, not lists: a list's every link is an int object of its own (36 bytes a link, not 4).
        self._next = array("i", range(1, num_blocks + 1))
        self._next.append(0 if num_blocks else end)
        self._prev = array("i", [end])
        self._prev.extend(range(num_blocks - 1))
        self._prev.append(num_blocks - 1 if num_blocks else end)
        self._len = num_blocks
        # Nodes whose links changed (the sentinel's too), per reader copying the links a slice at a time:
        # shared with the pool that owns the queue (BlockPool.watches).
        self.watches: list[set[int]] = []

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        return 0 <= block < self._end and self._prev[block] >= 0

    def links(self, start: int, end: int) -> tuple[array[int], array[int]]:
        """The next and previous links of nodes `start` .. `end`-1 (the sentinel is node `num_blocks`),
        for a copy of the queue that memctl check walks (memd.state_copy)."""
        return self._next[start:end], self._prev[start:end]

    def link(self, node: int) -> tuple[int, int]:
        """One node's next and previous links (`links` of one)."""
        return self._next[node], self._prev[node]

    def __iter__(self) -> Iterator[int]:
        node, seen = self._next[self._end], 0
        while node != self._end and seen <= self._len:
            yield node
            node, seen = self._next[node], seen + 1

    def _insert_after(self, block: int, prev: int) -> None:
        nxt = self._next[prev]
        self._prev[block], self._next[block] = prev, nxt
        self._next[prev] = block
        self._prev[nxt] = block
        self._len += 1
        for watch in self.watches:
            watch.update((block, prev, nxt))

    def push_front(self, block: int) -> None:
        self._insert_after(block, self._end)

    def push_back(self, block: int) -> None:
        self._insert_after(block, self._prev[self._end])

    def remove(self, block: int) -> tuple[int, int]:
        """Unlink `block` (a block id, 0 <= block < num_blocks); returns its (prev, next) neighbours, which
        `relink` needs to undo it.

        ValueError for a block out of the queue: its previous is -1, so unlinking it would point the sentinel
        (`_next[-1]`) at a stale neighbour and lose the blocks in between. The check costs one comparison.
        """
        prev, nxt = self._prev[block], self._next[block]
        if prev < 0:
            raise ValueError(f"block {block} is not in the free queue")
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._prev[block] = -1
        self._len -= 1
        for watch in self.watches:
            watch.update((block, prev, nxt))
        return prev, nxt

    def remove_n(self, blocks: list[int]) -> list[tuple[int, int, int]]:
        """`remove` of each of `blocks` in turn; returns their (block, prev, next), for `relink` in reverse.

        A swap-in takes back thousands of cached pages: one watch update for
        the run, not one per block. ValueError, with the queue as it was, if one is out of it.
        """
        nxt_of, prv_of = self._next, self._prev
        if len(blocks) > 1 and prv_of[blocks[0]] >= 0 and list(map(nxt_of.__getitem__, blocks[:-1])) == blocks[1:]:
            return self._remove_linked_run(blocks)
        unlinked: list[tuple[int, int, int]] = []
        for block in blocks:
            prev, nxt = prv_of[block], nxt_of[block]
            if prev < 0:
                for gone, before, after in reversed(unlinked):
                    prv_of[gone], nxt_of[gone], nxt_of[before], prv_of[after] = before, after, gone, gone
                raise ValueError(f"block {block} is not in the free queue")
            nxt_of[prev], prv_of[nxt], prv_of[block] = nxt, prev, -1
            unlinked.append((block, prev, nxt))
        self._len -= len(unlinked)
        for watch in self.watches:
            watch.update(chain.from_iterable(unlinked))
        return unlinked

    def _remove_linked_run(self, blocks: list[int]) -> list[tuple[int, int, int]]:
        """`remove_n` of blocks that follow one another in the queue, the first of them queued (so all are):
        a sequence's cached pages went back to the queue together and are taken back together. Unlinked
        at once; one by one, each would have had the run's outer previous and its own next as neighbours."""
        nxt_of, prv_of = self._next, self._prev
        before, after = prv_of[blocks[0]], nxt_of[blocks[-1]]
        nxt_of[before], prv_of[after] = after, before
        for block in blocks:
            prv_of[block] = -1
        self._len -= len(blocks)
        for watch in self.watches:
            watch.update(blocks)
            watch.update((before, after))
        return list(zip(blocks, repeat(before, len(blocks)), [*blocks[1:], after], strict=True))

    def relink(self, block: int, prev: int, nxt: int) -> None:
        """Put `block` back between the neighbours `remove` returned.

        Correct when every queue change since that removal has been undone, as
        an undo log replayed backwards guarantees: then `prev` and `nxt` are adjacent again.
        """
        self._prev[block], self._next[block] = prev, nxt
        self._next[prev] = block
        self._prev[nxt] = block
        self._len += 1
        for watch in self.watches:
            watch.update((block, prev, nxt))

    def first(self) -> int:
        return self._next[self._end]

    def take_front(self, n: int) -> list[int]:
        """Unlink the first `n` blocks (the caller checked there are); `put_front` of them undoes it."""
        nxt, prv, node = self._next, self._prev, self._end
        taken = []
        for _ in range(n):
            node = nxt[node]
            taken.append(node)
            prv[node] = -1
        after = nxt[node]
        nxt[self._end], prv[after] = after, self._end
        self._len -= n
        for watch in self.watches:
            watch.update(taken)
            watch.update((self._end, after))
        return taken

    def put_front(self, blocks: list[int]) -> None:
        """Link `blocks`, in this order, before the first block."""
        if blocks:
            self._link_run(blocks, self._end)

    def put_back(self, blocks: list[int]) -> None:
        """Link `blocks`, in this order, after the last block."""
        if blocks:
            self._link_run(blocks, self._prev[self._end])

    def _link_run(self, blocks: list[int], prev: int) -> None:
        nxt, prv = self._next, self._prev
        last = nxt[prev]
        for watch in self.watches:
            watch.update(blocks)
            watch.update((prev, last))
        for block in blocks:
            nxt[prev] = block
            prv[block] = prev
            prev = block
        nxt[prev], prv[last] = last, prev
        self._len += len(blocks)


class BlockPool:
    """Ref counts, the free queue and the prefix-cache index of `num_blocks` pages."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Per-page numbers in typed arrays, not lists: a million-page pool costs memd about 50 bytes a page, not
        # the 200 of lists whose non-zero entries are each an object of its own (memd's memory per page).
        self.ref = array("i", bytes(4 * num_blocks))
        self.free = FreeQueue(num_blocks)
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.tokens_of: list[bytes | None] = [None] * num_blocks      # memd.sequences.token_bytes
        # Of a block in the prefix cache: its parent's hash (b"": the first block of its chain), its model and
        # the salt its chain was cached under ("": none). Only what publishes the cache reads it
        # (memd.kv_events): valid while hash_of is set.
        self.origin_of: list[tuple[bytes, str, str] | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        # Written since it was last zeroed: the pool starts zeroed, so a page's
        # first allocation needs no memset.
        self.dirty = bytearray(num_blocks)
        self.last_access = array("d", bytes(8 * num_blocks))
        # What the page holds, as its worker committed it (shared.page_checksum; 0: unknown): a full
        # committed block's until the page is handed out again, a parked partial block's until resumed.
        self.checksum = array("Q", bytes(8 * num_blocks))
        self.undo: UndoLog | None = None
        # Pages that became free, ever: a Step that freed none has no effect on a page it gave back (memd.manager).
        self.freed = 0
        # Blocks whose ref count, access time, prefix hash, checksum or queue links changed, one set per reader
        # that copies the pool a slice at a time between Steps (memd.state_copy): it copies them again at the end.
        self.watches: list[set[int]] = self.free.watches

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        """Free blocks still holding a reusable prefix."""
        return sum(1 for b in self.free if self.hash_of[b] is not None)

    def allocate(self) -> tuple[int, bool]:
        """A block with ref count 1 for new content, and whether its page must be zeroed."""
        if not self.free:
            raise PoolExhausted(1, 0)
        block = self.free.first()
        links = self.free.remove(block)
        old_hash, old_tokens, was_dirty = self.hash_of[block], self.tokens_of[block], self.dirty[block]
        if old_hash is not None:
            del self.by_hash[old_hash]
            self.hash_of[block] = self.tokens_of[block] = None
        self.ref[block] = 1
        self.dirty[block] = 1
        if self.undo is not None:
            self.undo.record(self._undo_allocate, block, links, old_hash, old_tokens, was_dirty,
                                self.last_access[block], self.checksum[block])
        self.last_access[block] = time.monotonic()
        self.checksum[block] = 0
        return block, bool(was_dirty)          # the watches have it already: its queue links changed

    def _undo_allocate(self, block: int, links: tuple[int, int], old_hash: bytes | None,
                       old_tokens: bytes | None, was_dirty: int, last_access: float,
                       checksum: int) -> None:
        self.ref[block] = 0
        self.dirty[block] = was_dirty
        self.last_access[block] = last_access
        self.checksum[block] = checksum
        if old_hash is not None:
            self.hash_of[block], self.tokens_of[block] = old_hash, old_tokens
            self.by_hash[old_hash] = block
        self.free.relink(block, *links)

    def allocate_n(self, n: int) -> tuple[list[int], list[int]]:
        """`n` blocks with ref count 1 for new content (as `allocate` n times), and those whose pages must be zeroed.

        PoolExhausted, with nothing changed, when fewer than `n` are free.
        """
        if n > len(self.free):
            raise PoolExhausted(n, len(self.free))
        if n == 0:
            return [], []
        blocks = self.free.take_front(n)          # which notes them in the watches (the queue's own)
        get = itemgetter(*blocks) if n > 1 else lambda values: (values[blocks[0]],)
        hashes, was_dirty = get(self.hash_of), get(self.dirty)
        evicted = []
        if hashes.count(None) != n:              # cached prefixes leave the index with their pages
            tokens_of, by_hash = self.tokens_of, self.by_hash
            for block, digest in zip(blocks, hashes, strict=True):
                if digest is not None:
                    evicted.append((block, digest, tokens_of[block]))
                    del by_hash[digest]
                    self.hash_of[block] = tokens_of[block] = None
        if self.undo is not None:
            self.undo.record(self._undo_allocate_n, tuple(blocks), evicted, was_dirty, get(self.last_access),
                             get(self.checksum))
        ref, dirty, last_access, checksum, now = self.ref, self.dirty, self.last_access, self.checksum, time.monotonic()
        for block in blocks:
            ref[block] = dirty[block] = 1
            last_access[block], checksum[block] = now, 0
        return blocks, list(compress(blocks, was_dirty))

    def _undo_allocate_n(self, blocks: tuple[int, ...], evicted: list[tuple[int, bytes, bytes]],
                         was_dirty: tuple[int, ...], last_access: tuple[float, ...],
                         checksum: tuple[int, ...]) -> None:
        for block, dirty, touched, check in zip(blocks, was_dirty, last_access, checksum, strict=True):
            self.ref[block], self.dirty[block], self.last_access[block], self.checksum[block] = 0, dirty, touched, check
        for block, digest, tokens in evicted:
            self.hash_of[block], self.tokens_of[block] = digest, tokens
            self.by_hash[digest] = block
        self.free.put_front(list(blocks))

    def release_n(self, blocks: list[int]) -> int:
        """Drop one reference from each of `blocks` (as `decref` of each in turn); returns how many became free."""
        ref, hash_of, last_access = self.ref, self.hash_of, self.last_access
        if self.undo is not None:                # a copy: the caller may reuse its list
            self.undo.record(self._undo_release_n, tuple(blocks), picked(last_access, blocks))
        for watch in self.watches:
            watch.update(blocks)
        uncached: list[int] = []
        cached: list[int] = []
        now = time.monotonic()
        for block in blocks:
            count = ref[block] - 1
            ref[block] = count
            if not count:
                last_access[block] = now
                if hash_of[block] is None:
                    uncached.append(block)
                else:
                    cached.append(block)
        uncached.reverse()                       # each pushed to the front in turn: the last one ends first
        self.free.put_front(uncached)
        self.free.put_back(cached)
        self.freed += len(uncached) + len(cached)
        return len(uncached) + len(cached)

    def _undo_release_n(self, blocks: tuple[int, ...], last_access: tuple[float, ...]) -> None:
        for block, touched in zip(blocks, last_access, strict=True):
            if not self.ref[block]:
                self.free.remove(block)
            self.ref[block] += 1
            self.last_access[block] = touched

    def incref(self, block: int) -> None:
        for watch in self.watches:
            watch.add(block)
        links = self.free.remove(block) if self.ref[block] == 0 else None
        self.ref[block] += 1
        if self.undo is not None:
            self.undo.record(self._undo_incref, block, links, self.last_access[block])
        self.last_access[block] = time.monotonic()

    def incref_n(self, blocks: list[int]) -> None:
        """One more reference to each of `blocks` (as `incref` of each in turn): a run of prefix hits."""
        if not blocks:
            return
        for watch in self.watches:
            watch.update(blocks)
        ref, last_access = self.ref, self.last_access
        touched = picked(last_access, blocks)
        leaving = []                             # the free ones, in order: they leave the queue
        for block in blocks:
            if not ref[block]:
                leaving.append(block)
            ref[block] += 1
        try:
            unlinked = self.free.remove_n(leaving)
        except ValueError:
            for block in blocks:
                ref[block] -= 1
            raise
        if self.undo is not None:
            self.undo.record(self._undo_incref_n, tuple(blocks), unlinked, touched)
        now = time.monotonic()
        for block in blocks:
            last_access[block] = now

    def _undo_incref_n(self, blocks: tuple[int, ...], unlinked: list[tuple[int, int, int]],
                       last_access: tuple[float, ...]) -> None:
        for block, touched in zip(blocks, last_access, strict=True):
            self.ref[block] -= 1
            self.last_access[block] = touched
        for block, prev, nxt in reversed(unlinked):      # relinked in reverse order of removal (the docstring)
            self.free.relink(block, prev, nxt)

    def _undo_incref(self, block: int, links: tuple[int, int] | None, last_access: float) -> None:
        self.last_access[block] = last_access
        self.ref[block] -= 1
        if links is not None:
            self.free.relink(block, *links)

    def decref(self, block: int) -> bool:
        """Drop one reference; True when the block became free."""
        for watch in self.watches:
            watch.add(block)
        self.ref[block] -= 1
        freed = self.ref[block] == 0
        if self.undo is not None:
            self.undo.record(self._undo_decref, block, freed, self.last_access[block])
        if freed:
            if self.hash_of[block] is None:
                self.free.push_front(block)
            else:
                self.free.push_back(block)
            self.last_access[block] = time.monotonic()
            self.freed += 1
        return freed

    def _undo_decref(self, block: int, freed: bool, last_access: float) -> None:
        self.last_access[block] = last_access
        if freed:
            self.free.remove(block)
        self.ref[block] += 1

    def register(self, block: int, digest: bytes, tokens: bytes) -> None:
        """Offer a full, committed block to the prefix cache; first come keeps the hash."""
        if self.hash_of[block] is not None or digest in self.by_hash:
            return
        self.hash_of[block], self.tokens_of[block] = digest, tokens
        self.by_hash[digest] = block
        self.origin_of[block] = (b"", "", "")
        for watch in self.watches:
            watch.add(block)
        if self.undo is not None:
            self.undo.record(self._undo_register, block, digest)

    def register_n(self, blocks: list[int], digests: Iterable[bytes], tokens: Iterable[bytes],
                   parents: Iterable[bytes], model: str, salt: str = "") -> None:
        """`register` of each block in turn, with one watch update; `parents`: each block's parent's hash."""
        hash_of, tokens_of, by_hash, origin_of = self.hash_of, self.tokens_of, self.by_hash, self.origin_of
        taken = []
        for block, digest, chunk, parent in zip(blocks, digests, tokens, parents, strict=True):
            if hash_of[block] is None and digest not in by_hash:
                hash_of[block], tokens_of[block] = digest, chunk
                by_hash[digest] = block
                origin_of[block] = (parent, model, salt)
                taken.append(block)
        for watch in self.watches:
            watch.update(taken)
        if self.undo is not None and taken:
            self.undo.record(self._undo_register_n, taken)

    def _undo_register_n(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            del self.by_hash[self.hash_of[block]]                # type: ignore[arg-type]
            self.hash_of[block] = self.tokens_of[block] = None

    def _undo_register(self, block: int, digest: bytes) -> None:
        del self.by_hash[digest]
        self.hash_of[block] = self.tokens_of[block] = None

    def set_checksum(self, block: int, checksum: int) -> None:
        """What the page holds now (0: unknown, as when it may be written again)."""
        if self.undo is not None:
            self.undo.record(self.checksum.__setitem__, block, self.checksum[block])
        self.checksum[block] = checksum
        for watch in self.watches:
            watch.add(block)

    def set_checksums(self, blocks: list[int], checksums: list[int]) -> None:
        """`set_checksum` of each block in turn, with one watch update and one undo record."""
        if self.undo is not None:
            self.undo.record(self._undo_set_checksums, blocks, picked(self.checksum, blocks))
        checksum = self.checksum
        for block, value in zip(blocks, checksums, strict=True):
            checksum[block] = value
        for watch in self.watches:
            watch.update(blocks)

    def _undo_set_checksums(self, blocks: list[int], old: tuple[int, ...]) -> None:
        for block, value in zip(blocks, old, strict=True):      # all read before any was set
            self.checksum[block] = value

    def unregister(self, block: int) -> None:
        """Take a block out of the prefix cache: its page failed a check."""
        digest, tokens = self.hash_of[block], self.tokens_of[block]
        if digest is not None:
            del self.by_hash[digest]
            self.hash_of[block] = self.tokens_of[block] = None
            for watch in self.watches:
                watch.add(block)
            if self.undo is not None:
                self.undo.record(self._undo_unregister, block, digest, tokens)

    def _undo_unregister(self, block: int, digest: bytes, tokens: bytes) -> None:
        self.hash_of[block], self.tokens_of[block] = digest, tokens
        self.by_hash[digest] = block

    def lookup(self, digest: bytes, tokens: bytes) -> int | None:
        """The cached block for a prefix; token ids are compared so a hash collision never hits."""
        block = self.by_hash.get(digest)
        if block is None or self.tokens_of[block] != tokens:
            return None
        return block

    def cached_run(self, chain: Iterable[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, int]]:
        """(hash, block) of each block of `chain` (a prefix's hashes and token bytes, in order) the prefix cache
        holds, up to the first it does not: what a prompt may share. A lazy chain is hashed no further."""
        for digest, tokens in chain:
            block = self.lookup(digest, tokens)
            if block is None:
                return
            yield digest, block

    def lookup_run(self, digests: list[bytes], tokens: bytes) -> list[int | None]:
        """`lookup` of consecutive full blocks at once: `tokens` holds theirs, an equal share each.

        A swapped-out 128k-token history is 8,192 blocks: looked up one by one,
        they hold memd's loop for a Python step each; this is one dict pass
        and, when all of them are cached (a swap-in with no pressure since),
        one comparison.
        """
        if not digests:
            return []
        found, tokens_of = list(map(self.by_hash.get, digests)), self.tokens_of
        stride = len(tokens) // len(digests)
        if None not in found:
            cached: list[bytes] = list(map(tokens_of.__getitem__, found))     # type: ignore[arg-type]
            # One length for all (so each one's own share) and the same bytes: the run is the history.
            if len(set(map(len, cached))) == 1 and b"".join(cached) == tokens:
                return found
        return [block if block is not None and tokens_of[block] == tokens[i * stride:(i + 1) * stride] else None
                for i, block in enumerate(found)]

class SwapSlots:
    """Which slots are free: a stack, so a swap-out of k blocks mostly gets k consecutive slots."""

    __slots__ = ("_free", "checksum", "in_copy", "low_marks", "num_slots")

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # What each slot's last swap-out wrote (0: unknown): a swap-in checks the page it brings back.
        self.checksum = array("Q", bytes(8 * num_slots))
        self._free = array("i", range(num_slots - 1, -1, -1))
        # Owned by a copy, by no sequence: a swap-out's target, or a swap-in's source until read.
        self.in_copy: set[int] = set()
        # The fewest free slots since a reader began copying the free stack a slice at a time
        # (memd.state_copy), one per reader: the stack changes at its top only, so below that it is as copied.
        self.low_marks: list[list[int]] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """`count` slots, owned by the caller's copy (in `in_copy`) until `assign` or `give`."""
        if count > len(self._free):
            raise ValueError(f"{count} swap slots asked, {len(self._free)} free")
        if not count:
            return []
        taken = self._free[-count:][::-1].tolist()
        del self._free[-count:]
        self.in_copy.update(taken)
        for mark in self.low_marks:
            mark[0] = min(mark[0], len(self._free))
        return taken

    def assign(self, slots: Iterable[int]) -> None:
        """A copy is done with these slots; they now belong to a sequence."""
        self.in_copy.difference_update(slots)

    def claim(self, slots: list[int]) -> None:
        """Mark slots as held by sequences (those recovered from the journal)."""
        taken = set(slots)
        self._free = array("i", [slot for slot in self._free if slot not in taken])
        for mark in self.low_marks:
            mark[0] = 0

    def give(self, slots: list[int]) -> None:
        self.in_copy.difference_update(slots)
        self._free.extend(reversed(slots))

    def free_slots(self, start: int = 0, end: int | None = None) -> list[int]:
        """The free stack, bottom first (a part of it: from `start` to `end`)."""
        return self._free[start:end].tolist()
