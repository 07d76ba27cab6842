"""kubetrain.integrations.leave: a finished training process leaves at exit with the script's own exit code and
without the interpreter's teardown (where torch's gloo can abort). Each case is a real Python process; an atexit
hook registered before the leave hook stands for that teardown (it runs after the leave hook, or never)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kubetrain.integrations.leave import exit_status

PRELUDE = """
import atexit, sys
atexit.register(lambda: print("teardown ran", flush=True))
from kubetrain.integrations.leave import leave_at_exit, register_leave
register_leave()
atexit.register(lambda: print("later hook ran"))
print("unflushed output", end="")
"""


def run(body: str) -> subprocess.CompletedProcess[str]:
    script = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("body", "code"), [
    ("leave_at_exit()", 0),
    ("leave_at_exit(143)", 143),
    ("leave_at_exit()\nsys.exit(3)", 3),
    ("leave_at_exit(143)\nsys.exit()", 0),
    ("leave_at_exit()\nsys.exit('bad input')", 1),
], ids=["end", "armed-code", "sys-exit-code", "sys-exit-none", "sys-exit-message"])
def test_an_armed_process_leaves_with_its_own_code_skipping_the_teardown(body: str, code: int) -> None:
    proc = run(body)
    assert proc.returncode == code, proc.stderr
    assert "teardown ran" not in proc.stdout
    assert "later hook ran" in proc.stdout and "unflushed output" in proc.stdout  # flushed before leaving


def test_an_uncaught_exception_is_left_to_python() -> None:
    proc = run("leave_at_exit()\nraise RuntimeError('boom')")
    assert proc.returncode == 1
    assert "RuntimeError: boom" in proc.stderr and "teardown ran" in proc.stdout


def test_a_process_never_armed_exits_as_ever() -> None:
    proc = run("sys.exit(4)")
    assert proc.returncode == 4 and "teardown ran" in proc.stdout


@pytest.mark.parametrize(("status", "code"), [(None, 0), (0, 0), (7, 7), ("a message", 1)])
def test_exit_status_is_the_code_python_exits_with(status: str | int | None, code: int) -> None:
    assert exit_status(status) == code
