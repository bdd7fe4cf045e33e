"""What can go wrong with a request, as types; memd.service maps them to gRPC codes."""

from __future__ import annotations


class KvError(Exception):
    """A request memd refuses; the message is meant for the operator or client author.

    `reason`, where set, is what a client acts on without reading the message (it travels beside it:
    trailing metadata, or a refused Step's `reason`): "session_busy", say, tells an HTTP front door to
    answer 409 with OpenAI's error code for it.
    """

    code = "INTERNAL"
    reason = ""


class InvalidArgument(KvError):
    code = "INVALID_ARGUMENT"


class NotFound(KvError):
    code = "NOT_FOUND"


class AlreadyExists(KvError):
    code = "ALREADY_EXISTS"


class PermissionDenied(KvError):
    code = "PERMISSION_DENIED"


class FailedPrecondition(KvError):
    code = "FAILED_PRECONDITION"


class SessionBusy(FailedPrecondition):
    """The session's sequence is running: a turn of it is in flight, on this worker or another."""

    reason = "session_busy"


class SessionTaken(AlreadyExists):
    """A new sequence under a session's name while the session's own runs: a turn of it is in flight."""

    reason = "session_busy"


class RunningElsewhere(PermissionDenied):
    """The sequence is running on another worker: only that worker may change it until its turn ends."""

    reason = "session_busy"


class PoolExhausted(KvError):
    code = "RESOURCE_EXHAUSTED"

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"pool exhausted: {needed} more block(s) needed, {free} free")
        self.needed, self.free = needed, free


class PositionError(InvalidArgument):
    def __init__(self, seq_id: int, pos: int, num_committed: int) -> None:
        super().__init__(f"sequence {seq_id}: position {pos} is outside its {num_committed} committed tokens")


class OpError(KvError):
    """An error of one operation of a Step; says which, so a worker can retry without it.

    The index travels beside the message (gRPC trailing metadata), not in it:
    the message reaches operators and clients ("free: no session 'x'"), who
    never saw the Step it was part of.
    """

    def __init__(self, index: int, what: str, cause: KvError) -> None:
        super().__init__(f"{what}: {cause}")
        self.index, self.cause = index, cause
        self.code, self.reason = cause.code, cause.reason
