"""Leaving a finished training process at exit without the interpreter's teardown.

torch 2.13's gloo can abort in interpreter teardown, even after destroy_process_group ("terminate called
without an active exception", exit 134), turning a rank that finished training into a failed one: the gang
restarts although it is done. kubetrain's own trainer leaves with os._exit once main() returns; a library's
training loop (a Hugging Face Trainer script) cannot, since the user's code runs after it. So the integration
arms an exit hook when training ends: once the script is done it flushes the output streams and logging and
leaves with the script's own exit code, skipping the teardown. Standard library only.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from typing import NoReturn, Protocol

__all__ = ["exit_status", "leave_at_exit", "register_leave"]


class _Leaving:
    """Whether and with which code this process leaves at exit."""

    def __init__(self) -> None:
        self.registered = False
        self.armed = False
        self.code = 0


_LEAVING = _Leaving()
ExitStatus = str | int | None
"""What sys.exit takes."""


class _Exit(Protocol):
    def __call__(self, status: ExitStatus = None, /) -> NoReturn: ...


def exit_status(status: ExitStatus) -> int:
    """The process exit code of `sys.exit(status)`, as Python makes it."""
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


def register_leave() -> None:
    """Put the exit hook in place; it does nothing until `leave_at_exit` arms it. atexit runs its hooks last in,
    first out: registered early (when the integration's callback is made), the hook runs after those that later
    code adds (the progress reporter's last record, an experiment tracker's upload, TensorBoard writers)."""
    if not _LEAVING.registered:
        _LEAVING.registered = True
        atexit.register(_leave)


def leave_at_exit(code: int = 0) -> None:
    """Once the script is done, leave with `code`, or with the status of a later `sys.exit(...)`, without the
    interpreter's teardown. An uncaught exception is left to Python (it prints it and exits 1); a script that
    raises SystemExit itself rather than calling sys.exit leaves with `code`."""
    register_leave()
    _LEAVING.code = code
    if not _LEAVING.armed:
        _LEAVING.armed = True
        sys.exit = _recording(sys.exit)


def _recording(original: _Exit) -> _Exit:
    def recording_exit(status: ExitStatus = None, /) -> NoReturn:
        _LEAVING.code = exit_status(status)
        original(status)

    return recording_exit


def _leave() -> None:
    if not _LEAVING.armed or getattr(sys, "last_value", None) is not None:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(_LEAVING.code)
