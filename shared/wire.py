"""Codecs between kvpool's values and what crosses the wire.

Pool handles travel as msgpack (all fields ints, bytes and strings: nothing
is unpickled from the network). Step operations travel as protobuf; these
functions are the one place that maps them to and from `shared.ops`.
"""

from __future__ import annotations

from typing import Any

import msgpack

from shared import ops
from shared.rpc import memd_pb2 as pb

HANDLE_VERSION = 1
# Trailing metadata of a refused Step: the index of the operation that failed.
OP_INDEX_KEY = "kvpool-op-index"
# Trailing metadata of a refused Step: the pool's free blocks at that moment.
FREE_BLOCKS_KEY = "kvpool-free-blocks"
_HANDLE_FIELDS = {
    "shm": {"size": int, "socket": str, "token": bytes},
    "cuda": {"uuid": str, "handle": bytes, "size": int, "offset": int, "ref_counter_handle": bytes,
             "ref_counter_offset": int, "event_handle": bytes, "event_sync_required": bool},
}


class WireError(ValueError):
    """Bytes that are not what they claim to be."""


def encode_handle(handle: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": HANDLE_VERSION, **handle}, use_bin_type=True)


def decode_handle(data: bytes) -> dict[str, Any]:
    """A pool handle, checked field by field."""
    try:
        handle = msgpack.unpackb(data, raw=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise WireError(f"pool handle is not msgpack: {exc}") from None
    if not isinstance(handle, dict) or handle.get("v") != HANDLE_VERSION:
        raise WireError(f"pool handle of unknown version {handle.get('v') if isinstance(handle, dict) else None}")
    fields = _HANDLE_FIELDS.get(handle.get("backend"))
    if fields is None:
        raise WireError(f"pool handle names unknown backend {handle.get('backend')!r}")
    for name, kind in fields.items():
        if not isinstance(handle.get(name), kind):
            raise WireError(f"pool handle field {name!r} is missing or not {kind.__name__}")
    return handle


def op_to_proto(op: ops.Op) -> pb.Op:
    match op:
        case ops.Open():
            return pb.Op(open=pb.OpenOp(session_id=op.session_id or "", token_ids=op.token_ids,
                                        reserve=op.reserve, continue_session=op.continue_session,
                                        turn_id=op.turn_id or "", whole_history=op.whole_history))
        case ops.Extend():
            return pb.Op(extend=pb.ExtendOp(seq_id=op.seq_id, append=op.append, commit_to=op.commit_to,
                                            reserve=op.reserve, sums_from=op.sums_from, page_sums=op.page_sums))
        case ops.Park():
            return pb.Op(park=pb.ParkOp(seq_id=op.seq_id, append=op.append, commit_to=op.commit_to,
                                        preempt=op.preempt, sums_from=op.sums_from, page_sums=op.page_sums))
        case ops.Resume():
            if op.session_id:
                return pb.Op(resume=pb.ResumeOp(session_id=op.session_id, reserve=op.reserve))
            return pb.Op(resume=pb.ResumeOp(seq_id=op.seq_id or 0, reserve=op.reserve))
        case ops.Free():
            sums = {"sums_from": op.sums_from, "page_sums": op.page_sums, "distrusted": op.distrusted}
            if op.session_id:
                return pb.Op(free=pb.FreeOp(session_id=op.session_id, append=op.append, commit_to=op.commit_to,
                                            **sums))
            return pb.Op(free=pb.FreeOp(seq_id=op.seq_id or 0, append=op.append, commit_to=op.commit_to, **sums))
        case ops.Fork():
            return pb.Op(fork=pb.ForkOp(seq_id=op.seq_id, session_id=op.session_id or ""))
    raise TypeError(f"not a Step operation: {op!r}")


def op_from_proto(msg: pb.Op) -> ops.Op:
    kind = msg.WhichOneof("kind")
    if kind == "open":
        m = msg.open
        return ops.Open(list(m.token_ids), m.reserve, m.session_id or None, m.continue_session, m.turn_id or None,
                        m.whole_history)
    if kind == "extend":
        m = msg.extend
        return ops.Extend(m.seq_id, list(m.append), m.commit_to, m.reserve, m.sums_from, list(m.page_sums))
    if kind == "park":
        m = msg.park
        return ops.Park(m.seq_id, list(m.append), m.commit_to, m.preempt, m.sums_from, list(m.page_sums))
    if kind == "resume":
        m = msg.resume
        return ops.Resume(m.seq_id or None, m.session_id or None, m.reserve)
    if kind == "free":
        m = msg.free
        return ops.Free(m.seq_id or None, m.session_id or None, list(m.append), m.commit_to, m.sums_from,
                        list(m.page_sums), list(m.distrusted))
    if kind == "fork":
        return ops.Fork(msg.fork.seq_id, msg.fork.session_id or None)
    raise WireError("empty operation: set one of open, extend, park, resume, free, fork")


def result_to_proto(r: ops.OpResult) -> pb.OpResult:
    return pb.OpResult(seq_id=r.seq_id, state=r.state, first_block=r.first_block, block_ids=r.block_ids,
                       num_blocks=r.num_blocks, num_committed=r.num_committed, num_cached=r.num_cached,
                       token_ids=r.token_ids or ())


def result_from_proto(m: pb.OpResult, with_history: bool) -> ops.OpResult:
    return ops.OpResult(m.seq_id, m.state, m.first_block, list(m.block_ids), m.num_blocks, m.num_committed,
                        m.num_cached, list(m.token_ids) if with_history else None)
