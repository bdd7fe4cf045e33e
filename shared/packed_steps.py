"""A Step's ops and results as one msgpack array each: the only form a Step takes on the wire.

A decode Step is 16 small ops and 16 small results. As protobuf messages
they would be built and read field by field in Python, at both ends, which
costs more than anything memd does with them; packed, each op is `[kind,
[its fields in `shared.ops` order]]` and each result the fields of an
`OpResult`, and a Step's are packed and unpacked in C. A history (a resumed
sequence's token ids, up to a whole long chat) goes as the bytes of a
little-endian uint32 array, which msgpack copies instead of walking.

msgpack is untyped, so memd checks every field (`unpack_ops`) as protobuf's
types would: ints in their range, lists of such ints, strings or nil. A Step
that fails the check is refused whole (INVALID_ARGUMENT, naming the op) and
changes nothing.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import Any

import msgpack

from shared import ops
from shared.protobuf_codec import WireError

U32, U64 = 1 << 32, 1 << 64
MAX_SECONDS = 366 * 86400          # a duration on the wire: a year at most (and never inf or NaN)
_BIG_ENDIAN = sys.byteorder == "big"

# The kind codes: the protobuf Op oneof's field numbers.
_KINDS: dict[type, int] = {ops.Open: 1, ops.Extend: 2, ops.Park: 3, ops.Resume: 4, ops.Free: 5, ops.Fork: 6}
_FIELDS: dict[type, Callable[[Any], tuple]] = {kind: attrgetter(*kind.__slots__) for kind in _KINDS}
_RESULT_FIELDS = attrgetter(*ops.OpResult.__slots__)


class PackedOpError(WireError):
    """An op of a packed Step that is not what its kind says; `index` is its place in the Step."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


def pack_ops(step_ops: Iterable[ops.Op]) -> bytes:
    return msgpack.packb([(_KINDS[type(op)], _FIELDS[type(op)](op)) for op in step_ops], use_bin_type=True)


def unpack_ops(data: bytes) -> list[ops.Op]:
    """The ops of a packed Step, each field checked; WireError (PackedOpError for one op) if any is wrong."""
    try:
        items = msgpack.unpackb(data, raw=False, use_list=True)
    except (msgpack.UnpackException, ValueError) as exc:
        raise WireError(f"packed_ops is not msgpack: {exc}") from None
    if type(items) is not list:
        raise WireError("packed_ops must be an array of ops")
    out = []
    for index, item in enumerate(items):
        try:
            if type(item) is not list or len(item) != 2 or type(item[1]) is not list:
                raise WireError("an op is [kind, [fields]]")
            reader = _READERS.get(item[0]) if type(item[0]) is int else None
            if reader is None:
                raise WireError(f"unknown op kind {item[0]!r}: one of 1 (open) to 6 (fork)")
            out.append(reader(item[1]))
        except WireError as exc:
            raise PackedOpError(index, str(exc)) from None
    return out


def pack_results(results: list[ops.OpResult]) -> bytes:
    return msgpack.packb([_RESULT_FIELDS(r) if r.token_ids is None else
                          (*_RESULT_FIELDS(r)[:-1], packed_token_ids(r.token_ids)) for r in results],
                         use_bin_type=True)


def unpack_results(data: bytes) -> list[ops.OpResult]:
    """memd's results (trusted as memd's replies are): a history as a list of ints, else None."""
    results = [ops.OpResult(*fields) for fields in msgpack.unpackb(data, raw=False, use_list=True)]
    for r in results:
        if type(r.token_ids) is bytes:
            r.token_ids = unpacked_token_ids(r.token_ids).tolist()
    return results


def packed_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as they travel (a history, a Lookup's prompt): the bytes of a little-endian uint32 array."""
    history = token_ids if type(token_ids) is array and token_ids.typecode == "I" else array("I", token_ids)
    if _BIG_ENDIAN:
        history = array("I", history)
        history.byteswap()
    return history.tobytes()


def unpacked_token_ids(data: bytes) -> array[int]:
    """`packed_token_ids`' array again; WireError if `data` is not whole uint32s."""
    if len(data) % 4:
        raise WireError(f"token ids of {len(data)} bytes: not an array of uint32")
    token_ids = array("I")
    token_ids.frombytes(data)
    if _BIG_ENDIAN:
        token_ids.byteswap()
    return token_ids


# ---- checking what memd reads --------------------------------------------------

def _fields(fields: list, count: int, kind: str) -> list:
    if len(fields) != count:
        raise WireError(f"{kind} has {count} fields, not {len(fields)}")
    return fields


def _int(value: Any, limit: int, name: str) -> int:
    if type(value) is int and 0 <= value < limit:
        return value
    raise WireError(f"{name} must be an integer from 0 to {limit - 1}, not {value!r}")


def _ints(value: Any, typecode: str, name: str) -> list[int]:
    """A list of 32-bit ('I') or 64-bit ('Q') unsigned ints, checked in C."""
    if type(value) is not list:
        raise WireError(f"{name} must be an array of integers, not {type(value).__name__}")
    if value:
        try:
            array(typecode, value)
        except (TypeError, OverflowError):
            bits = 32 if typecode == "I" else 64
            raise WireError(f"{name} must hold integers from 0 to 2**{bits} - 1") from None
    return value


def _text(value: Any, name: str) -> str | None:
    """An optional string: nil or "" is none, as protobuf's empty string is."""
    if value is None or type(value) is str:
        return value or None
    raise WireError(f"{name} must be a string or nil, not {type(value).__name__}")


def _flag(value: Any, name: str) -> bool:
    if type(value) is bool:
        return value
    raise WireError(f"{name} must be true or false, not {value!r}")


def _seconds(value: Any, name: str) -> float:
    if type(value) in (int, float) and 0 <= value <= MAX_SECONDS:
        return float(value)
    raise WireError(f"{name} must be a number of seconds from 0 to {MAX_SECONDS}, not {value!r}")


def _open(f: list) -> ops.Open:
    token_ids, reserve, session_id, continue_session, turn_id, whole_history, cache_salt, tenant, retain_s = \
        _fields(f, 9, "open")
    return ops.Open(_ints(token_ids, "I", "token_ids"), _int(reserve, U32, "reserve"),
                    _text(session_id, "session_id"), _flag(continue_session, "continue_session"),
                    _text(turn_id, "turn_id"), _flag(whole_history, "whole_history"), _text(cache_salt, "cache_salt"),
                    _text(tenant, "tenant"), _seconds(retain_s, "retain_s"))


def _extend(f: list) -> ops.Extend:
    seq_id, append, commit_to, reserve, sums_from, page_sums = _fields(f, 6, "extend")
    return ops.Extend(_int(seq_id, U64, "seq_id"), _ints(append, "I", "append"), _int(commit_to, U32, "commit_to"),
                      _int(reserve, U32, "reserve"), _int(sums_from, U32, "sums_from"),
                      _ints(page_sums, "Q", "page_sums"))


def _park(f: list) -> ops.Park:
    seq_id, append, commit_to, preempt, sums_from, page_sums = _fields(f, 6, "park")
    return ops.Park(_int(seq_id, U64, "seq_id"), _ints(append, "I", "append"), _int(commit_to, U32, "commit_to"),
                    _flag(preempt, "preempt"), _int(sums_from, U32, "sums_from"), _ints(page_sums, "Q", "page_sums"))


def _target(seq_id: Any, session_id: Any) -> tuple[int | None, str | None]:
    """A sequence id or a session id, as protobuf's oneof target: a session wins, 0 and nil are none."""
    session = _text(session_id, "session_id")
    number = None if seq_id is None else _int(seq_id, U64, "seq_id")
    return (None, session) if session else (number or None, None)


def _resume(f: list) -> ops.Resume:
    seq_id, session_id, reserve = _fields(f, 3, "resume")
    return ops.Resume(*_target(seq_id, session_id), _int(reserve, U32, "reserve"))


def _free(f: list) -> ops.Free:
    seq_id, session_id, append, commit_to, sums_from, page_sums, distrusted = _fields(f, 7, "free")
    return ops.Free(*_target(seq_id, session_id), _ints(append, "I", "append"), _int(commit_to, U64, "commit_to"),
                    _int(sums_from, U32, "sums_from"), _ints(page_sums, "Q", "page_sums"),
                    _ints(distrusted, "I", "distrusted"))


def _fork(f: list) -> ops.Fork:
    seq_id, session_id = _fields(f, 2, "fork")
    return ops.Fork(_int(seq_id, U64, "seq_id"), _text(session_id, "session_id"))


_READERS: dict[Any, Callable[[list], ops.Op]] = {1: _open, 2: _extend, 3: _park, 4: _resume, 5: _free, 6: _fork}
