"""shared.wire: every Step operation and result, built in place into a request or reply, reads back as it was
sent (and as the message-by-message encoding has it, which tools and tests still use)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared import ops
from shared.rpc import memd_pb2 as pb
from shared.wire import op_from_proto, op_to_proto, ops_into, result_from_proto, results_into

ids = st.integers(1, 2**40)
small = st.integers(0, 2**31 - 1)
tokens = st.lists(st.integers(0, 2**32 - 1), max_size=20)
sums = st.lists(st.integers(0, 2**64 - 1), max_size=4)
names = st.one_of(st.none(), st.text(min_size=1, max_size=12))
target = st.one_of(st.tuples(ids, st.none()), st.tuples(st.none(), st.text(min_size=1, max_size=12)))

operations = st.one_of(
    st.builds(ops.Open, tokens, small, names, st.booleans(), names, st.booleans()),
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
def test_operations_built_in_place_read_back_as_sent(step_ops):
    request = pb.StepRequest(worker_id=3)
    ops_into(request.ops, step_ops)
    again = pb.StepRequest.FromString(request.SerializeToString())
    assert [op_from_proto(m) for m in again.ops] == step_ops
    assert list(again.ops) == [op_to_proto(op) for op in step_ops]


@given(st.lists(results, max_size=8))
def test_results_built_in_place_read_back_as_sent(step_results):
    reply = pb.StepReply(free_blocks=7)
    results_into(reply.results, step_results)
    again = pb.StepReply.FromString(reply.SerializeToString())
    read = [result_from_proto(m, with_history=r.token_ids is not None) for m, r in zip(again.results, step_results,
                                                                                     strict=True)]
    assert read == step_results
