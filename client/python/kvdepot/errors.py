"""Exceptions: one class per status of libkvdepot (a negated gRPC code).

Every error raised by kvdepot.Client is a KvdepotError subclass carrying the
status (``status``, the C library's negative code), its gRPC name (``code``,
e.g. ``"NOT_FOUND"``) and the server's message.
"""


class KvdepotError(Exception):
    """A call failed. ``status``: libkvdepot's code; ``code``: gRPC name."""

    status = -2
    code = "UNKNOWN"

    def __init__(self, message: str, status: int = None, code: str = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


class Cancelled(KvdepotError):
    status, code = -1, "CANCELLED"


class Unknown(KvdepotError):
    status, code = -2, "UNKNOWN"


class InvalidArgument(KvdepotError, ValueError):
    status, code = -3, "INVALID_ARGUMENT"


class DeadlineExceeded(KvdepotError, TimeoutError):
    status, code = -4, "DEADLINE_EXCEEDED"


class NotFound(KvdepotError, KeyError):
    status, code = -5, "NOT_FOUND"

    def __str__(self):  # KeyError would quote the message
        return Exception.__str__(self)


class AlreadyExists(KvdepotError):
    status, code = -6, "ALREADY_EXISTS"


class PermissionDenied(KvdepotError, PermissionError):
    status, code = -7, "PERMISSION_DENIED"


class ResourceExhausted(KvdepotError):
    status, code = -8, "RESOURCE_EXHAUSTED"


class FailedPrecondition(KvdepotError):
    status, code = -9, "FAILED_PRECONDITION"


class Aborted(KvdepotError):
    status, code = -10, "ABORTED"


class OutOfRange(KvdepotError, IndexError):
    status, code = -11, "OUT_OF_RANGE"


class Unimplemented(KvdepotError, NotImplementedError):
    status, code = -12, "UNIMPLEMENTED"


class Internal(KvdepotError):
    status, code = -13, "INTERNAL"


class Unavailable(KvdepotError, ConnectionError):
    status, code = -14, "UNAVAILABLE"


class DataLoss(KvdepotError):
    status, code = -15, "DATA_LOSS"


class Unauthenticated(KvdepotError):
    status, code = -16, "UNAUTHENTICATED"


_BY_STATUS = {
    cls.status: cls
    for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
                PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
                Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)
}


def error_for(status: int, message: str) -> KvdepotError:
    """The exception of a libkvdepot status."""
    cls = _BY_STATUS.get(status, KvdepotError)
    return cls(message or cls.code, status, cls.code)
