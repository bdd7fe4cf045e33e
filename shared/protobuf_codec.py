"""Codecs between kvpool's values and what crosses the wire.

Pool handles travel as msgpack (all fields ints, bytes and strings: nothing
is unpickled from the network). Step operations travel packed
(`shared.packed_steps`); what else a refusal or a handle carries is named
here, once for both ends.
"""

from __future__ import annotations

from typing import Any

import msgpack

HANDLE_VERSION = 1
# Trailing metadata of a refused call: the index of the operation that failed.
OP_INDEX_KEY = "kvpool-op-index"
# Trailing metadata of a refused call: the pool's free blocks at that moment.
FREE_BLOCKS_KEY = "kvpool-free-blocks"
# Trailing metadata of a refused call: a reason a client acts on (memd.errors.KvError.reason).
REASON_KEY = "kvpool-reason"
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
