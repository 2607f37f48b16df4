"""The one table of error codes, shared by the host and every guest SDK.

A host call returns a negative `ErrorCode` value on failure; Python callers get the matching
`SymphonyError` subclass instead. `wit/symphony.wit` and each SDK repeat this table, and a test
checks that they agree.
"""
from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Negative return codes of host calls. Zero and positive values are successful results."""

    INVALID_ARGUMENT = -1
    BAD_HANDLE = -2
    READ_ONLY = -3
    FILE_EXISTS = -4
    FILE_NOT_FOUND = -5
    PERMISSION_DENIED = -6
    POSITION_ERROR = -7
    POOL_EXHAUSTED = -8
    FILE_BUSY = -9
    BAD_POINTER = -10
    BUFFER_TOO_SMALL = -11
    LIMIT_EXCEEDED = -12
    UNSUPPORTED = -13
    INTERNAL = -14
    CLOSED = -15


class SymphonyError(Exception):
    """Base of every error Symphony raises on purpose; `code` is its ABI error code."""

    code: ErrorCode = ErrorCode.INTERNAL


class InvalidArgument(SymphonyError, ValueError):
    """An argument is malformed or out of range (a bad path, an empty token list, k <= 0, ...)."""

    code = ErrorCode.INVALID_ARGUMENT


class BadHandle(SymphonyError):
    """The KV handle is unknown, already closed, or belongs to someone else."""

    code = ErrorCode.BAD_HANDLE


class ReadOnlyFile(SymphonyError):
    """A write (pred append, truncate) through a handle opened read-only."""

    code = ErrorCode.READ_ONLY


class FileExists(SymphonyError):
    """`open` with CREATE | EXCLUSIVE of a name that already exists."""

    code = ErrorCode.FILE_EXISTS


class FileNotFound(SymphonyError):
    """No KV file has that name (it was never created, was removed, or was evicted)."""

    code = ErrorCode.FILE_NOT_FOUND


class PermissionDenied(SymphonyError):
    """The file belongs to another tenant and is not shared with the caller, or is shared read-only."""

    code = ErrorCode.PERMISSION_DENIED


class PositionError(SymphonyError):
    """Token positions must continue the file without gaps: the first new position is the file's
    next position and each following one is one larger."""

    code = ErrorCode.POSITION_ERROR


class PoolExhausted(SymphonyError):
    """The KV pool has no free page even after eviction and swapping; close or remove files."""

    code = ErrorCode.POOL_EXHAUSTED


class FileBusy(SymphonyError):
    """The file has a `pred` in flight; truncating or copying it (fork, extract, merge) now would
    race that write."""

    code = ErrorCode.FILE_BUSY


class BadPointer(SymphonyError):
    """A guest (pointer, length) pair does not lie inside the guest's linear memory."""

    code = ErrorCode.BAD_POINTER


class BufferTooSmall(SymphonyError):
    """The caller's output buffer cannot hold the result; the message says the size needed."""

    code = ErrorCode.BUFFER_TOO_SMALL


class LimitExceeded(SymphonyError):
    """A per-process or per-tenant limit (handles, pages, forks, bytes) was reached."""

    code = ErrorCode.LIMIT_EXCEEDED


class Unsupported(SymphonyError):
    """The request is valid but this build or model cannot serve it."""

    code = ErrorCode.UNSUPPORTED


class InputClosed(SymphonyError):
    """The user closed the process's input: no more messages will come."""

    code = ErrorCode.CLOSED


class OutputClosed(SymphonyError):
    """The user stopped reading the process's output (`symphony run ... | head`)."""

    code = ErrorCode.CLOSED
