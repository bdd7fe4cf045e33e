"""shared.packed_steps, the one form of a Step on the wire: every operation and result reads back as it was
sent; a packed Step that is not what it claims is refused, naming its op."""

from __future__ import annotations

import dataclasses
from array import array

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import ops
from shared.packed_steps import pack_ops, pack_results, unpack_ops, unpack_results
from shared.protobuf_codec import WireError

ids = st.integers(1, 2**40)
small = st.integers(0, 2**31 - 1)
tokens = st.lists(st.integers(0, 2**32 - 1), max_size=20)
sums = st.lists(st.integers(0, 2**64 - 1), max_size=4)
names = st.one_of(st.none(), st.text(min_size=1, max_size=12))
target = st.one_of(st.tuples(ids, st.none()), st.tuples(st.none(), st.text(min_size=1, max_size=12)))

operations = st.one_of(
    st.builds(ops.Open, tokens, small, names, st.booleans(), names, st.booleans(), names, names),
    st.builds(ops.Extend, ids, tokens, small, small, small, sums),
    st.builds(ops.Park, ids, tokens, small, st.booleans(), small, sums),
    target.flatmap(lambda t: st.builds(ops.Resume, st.just(t[0]), st.just(t[1]), small)),
    target.flatmap(lambda t: st.builds(ops.Free, st.just(t[0]), st.just(t[1]), tokens, small, small, sums,
                                       st.lists(small, max_size=4))),
    st.builds(ops.Fork, ids, names),
)
results = st.builds(ops.OpResult, ids, st.sampled_from(["running", "parked", "swapped"]), small,
                    st.lists(small, max_size=20), small, small, small, st.one_of(st.none(), tokens))


@given(st.lists(operations, max_size=8))
def test_packed_operations_read_back_as_sent(step_ops):
    assert unpack_ops(pack_ops(step_ops)) == step_ops


@given(st.lists(results, max_size=8))
def test_packed_results_read_back_as_sent(step_results):
    assert unpack_results(pack_results(step_results)) == step_results


@given(st.lists(results, max_size=8))
def test_histories_memd_keeps_as_arrays_read_back_as_lists(step_results):
    """memd's results hold a copy of a sequence's uint32 array; clients read a list."""
    as_memd = [dataclasses.replace(r, token_ids=None if r.token_ids is None else array("I", r.token_ids))
               for r in step_results]
    read = unpack_results(pack_results(as_memd))
    assert read == step_results
    assert all(r.token_ids is None or type(r.token_ids) is list for r in read)


def test_a_history_is_a_little_endian_uint32_array():
    result = ops.OpResult(5, "running", 0, [1], 1, 3, 0, token_ids=[1, 2**32 - 1, 258])
    (fields,) = msgpack.unpackb(pack_results([result]))
    assert fields[-1] == b"".join(t.to_bytes(4, "little") for t in (1, 2**32 - 1, 258))


EXTEND = [2, [7, [1], 1, 1, 0, []]]
MALFORMED = {
    "not msgpack": (b"\xc1", None, "not msgpack"),
    "not an array": (msgpack.packb({"ops": []}), None, "an array of ops"),
    "an op that is not [kind, fields]": (msgpack.packb([EXTEND, [2, 7]]), 1, "[kind, [fields]]"),
    "an unknown kind": (msgpack.packb([[9, []]]), 0, "unknown op kind 9"),
    "a kind that is a list": (msgpack.packb([EXTEND, [[2], []]]), 1, "unknown op kind [2]"),
    "a kind that is true": (msgpack.packb([[True, [7, 5]]]), 0, "unknown op kind True"),
    "a field missing": (msgpack.packb([[2, [7, [1], 1, 1, 0]]]), 0, "extend has 6 fields, not 5"),
    "a negative id": (msgpack.packb([EXTEND, [2, [-7, [1], 1, 1, 0, []]]]), 1, "seq_id must be an integer"),
    "a length past 32 bits": (msgpack.packb([[4, [2**64 - 1, None, 0]], [2, [7, [], 2**32, 0, 0, []]]]),
                              1, "commit_to must be an integer from 0 to 4294967295"),
    "a float": (msgpack.packb([[2, [7, [1], 1.5, 1, 0, []]]]), 0, "commit_to must be an integer"),
    "a token past 32 bits": (msgpack.packb([[1, [[1, 2**32], 0, None, False, None, False, None, None, 0]]]), 0,
                             "token_ids"),
    "a token that is text": (msgpack.packb([[2, [7, ["1"], 1, 1, 0, []]]]), 0, "append must hold integers"),
    "a negative checksum": (msgpack.packb([[3, [7, [], 1, False, 0, [-1]]]]), 0, "page_sums"),
    "a session id that is a number": (msgpack.packb([[6, [7, 5]]]), 0, "session_id must be a string"),
    "a flag that is a number": (msgpack.packb([[3, [7, [], 1, 1, 0, []]]]), 0, "preempt must be true or false"),
    "a list that is a string": (msgpack.packb([[1, ["abc", 0, None, False, None, False, None, None, 0]]]), 0,
                                "token_ids"),
    "a salt that is a number": (msgpack.packb([[1, [[1], 0, None, False, None, False, 7, None, 0]]]), 0, "cache_salt"),
    "a tenant that is a number": (msgpack.packb([[1, [[1], 0, None, False, None, False, None, 7, 0]]]), 0, "tenant"),
    "a retention past a year": (msgpack.packb([[1, [[1], 0, None, False, None, False, None, None, 1e12]]]), 0,
                                "retain_s must be a number of seconds"),
    "a retention that is text": (msgpack.packb([[1, [[1], 0, None, False, None, False, None, None, "1h"]]]), 0,
                                 "retain_s"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_packed_step_is_refused_naming_the_op(case):
    data, index, words = MALFORMED[case]
    with pytest.raises(WireError) as err:
        unpack_ops(data)
    assert words in str(err.value)
    assert getattr(err.value, "index", None) == index
