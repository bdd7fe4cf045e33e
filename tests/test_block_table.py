"""inferd.block_table: a table's tensor always says what its list says, however the list was changed; and a
batch's padded tables are the same through the tensors as through the lists."""

from __future__ import annotations

import copy
import pickle

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.block_table import FEW_ENTRIES, BlockTable, padded_tables
from inferd.model import build_batch

ids = st.integers(0, 10_000)
index = st.integers(-12, 12)
span = st.tuples(st.none() | index, st.none() | index, st.sampled_from([None, 1, 2, -1]))
changes = st.one_of(
    st.tuples(st.just("append"), ids), st.tuples(st.just("extend"), st.lists(ids, max_size=5)),
    st.tuples(st.just("iadd"), st.lists(ids, max_size=5)), st.tuples(st.just("set"), index, ids),
    st.tuples(st.just("set_slice"), span, st.lists(ids, max_size=5)), st.tuples(st.just("del"), index),
    st.tuples(st.just("del_slice"), span), st.tuples(st.just("insert"), index, ids),
    st.tuples(st.just("pop"), index), st.tuples(st.just("remove_first"),), st.tuples(st.just("clear"),),
    st.tuples(st.just("sort"),), st.tuples(st.just("reverse"),), st.tuples(st.just("imul"), st.integers(0, 2)),
    st.tuples(st.just("read"),), st.tuples(st.just("read"),),
)


def change(table: list[int], what: tuple) -> None:
    kind, *args = what
    try:
        if kind == "append":
            table.append(args[0])
        elif kind == "extend":
            table.extend(args[0])
        elif kind == "iadd":
            table += args[0]
        elif kind == "set":
            table[args[0]] = args[1]
        elif kind == "set_slice":
            table[slice(*args[0])] = args[1]
        elif kind == "del":
            del table[args[0]]
        elif kind == "del_slice":
            del table[slice(*args[0])]
        elif kind == "insert":
            table.insert(args[0], args[1])
        elif kind == "pop":
            table.pop(args[0])
        elif kind == "remove_first" and table:
            table.remove(table[0])
        elif kind == "clear":
            table.clear()
        elif kind == "sort":
            table.sort()
        elif kind == "reverse":
            table.reverse()
        elif kind == "imul":
            table *= args[0]
    except (IndexError, ValueError):       # as a list refuses them: both refuse alike
        pass


@settings(max_examples=500, deadline=None)
@given(st.lists(ids, max_size=20), st.lists(changes, max_size=25))
def test_a_tables_tensor_says_what_its_list_says_after_any_change(start, steps):
    table, plain = BlockTable(start), list(start)
    assert table.ids().tolist() == plain
    for what in steps:
        change(table, what)
        change(plain, what)
        assert list(table) == plain
        if what[0] == "read":
            assert table.ids().tolist() == plain
    assert table.ids().tolist() == plain


def test_a_copy_has_a_tensor_of_its_own():
    table = BlockTable([1, 2, 3])
    table.ids()
    for other in (copy.copy(table), copy.deepcopy(table), pickle.loads(pickle.dumps(table))):
        assert isinstance(other, BlockTable)
        other[0] = 9
        assert other.ids().tolist() == [9, 2, 3] and table.ids().tolist() == [1, 2, 3]


def test_padded_tables_are_the_same_from_tensors_and_from_lists():
    rng = torch.Generator().manual_seed(0)
    for per_row in (3, FEW_ENTRIES // 4):             # below and above where the tensors are used
        lists = [torch.randint(0, 1 << 20, (per_row + i,), generator=rng).tolist() for i in range(8)]
        counts = [per_row - i % 3 for i in range(8)]
        want = padded_tables(lists, counts)
        assert torch.equal(padded_tables([BlockTable(t) for t in lists], counts), want)
        assert want.shape == (8, per_row)
        assert all(want[i, n:].eq(lists[i][0]).all() for i, n in enumerate(counts))


def test_a_decode_batch_reads_the_same_blocks_through_a_table_that_grew():
    table = BlockTable(range(100, 140))
    before = build_batch([([1], 40 * 16 - 1, table)] * 40, 16)
    table.append(7)
    table[40:] = [8, 9]                                   # as a worker's table grows by what memd adds
    after = build_batch([([1], 42 * 16 - 1, table)] * 40, 16)
    assert torch.equal(before.block_tables, torch.tensor([list(range(100, 140))] * 40))
    assert torch.equal(after.block_tables, torch.tensor([list(range(100, 140)) + [8, 9]] * 40))
