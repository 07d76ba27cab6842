"""What the tests wait on being built, said in the test log rather than waited for in silence.

hack/prebuild.sh (started by .ci/run and `make test`) builds every Go part and image the suite needs in
the background; its progress file gets a line each time a part starts or finishes, with what is left.
``PrebuildProgress`` hands the test log each new line (tests/conftest.py prints them between tests).
A fixture that builds, or waits for a build, runs the hack/ script inside ``shown()``: the script's own
lines (a line per part, and every 30 s while it builds or waits) reach the terminal instead of pytest's
capture.
"""

from __future__ import annotations

import fcntl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest

from .cluster import cache_dir
from .paths import HACK_DIR


class _Session:
    """This pytest session, once tests/conftest.py has called register()."""

    config: pytest.Config | None = None
    progress: PrebuildProgress | None = None
    prebuild_was_running = False


_SESSION = _Session()


def register(config: pytest.Config) -> None:
    """Called by tests/conftest.py: ``shown()`` and ``report_progress()`` then reach pytest's capture and
    terminal, and the test log gets the background build's lines from now on."""
    _SESSION.config = config
    _SESSION.progress = PrebuildProgress()
    _SESSION.prebuild_was_running = prebuild_running()


def report_progress() -> None:
    """Print the background build's new progress lines in the test log (between tests)."""
    config, progress = _SESSION.config, _SESSION.progress
    terminal = config.pluginmanager.getplugin("terminalreporter") if config else None
    for line in progress.new_lines() if progress else []:
        if terminal is not None:
            _own_line(terminal, line)


@contextmanager
def shown(what: str = "") -> Iterator[None]:
    """Inside, what child processes and this one write goes to the terminal (pytest's capture is off),
    after a line naming ``what``; a no-op outside pytest."""
    config = _SESSION.config
    if config is None:
        yield
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    terminal = config.pluginmanager.getplugin("terminalreporter")
    with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
        if terminal is not None:  # inside: during a test's phases the terminal's stdout is captured too
            _own_line(terminal, what)
        yield


def _own_line(terminal: pytest.TerminalReporter, text: str) -> None:
    """``text`` on a line of its own (after -q's row of dots too); an empty text only ends that row."""
    terminal.ensure_newline()
    if terminal._tw.width_of_current_line:  # -q writes dots without the reporter noting a line is open
        terminal._tw.line()
    if text:
        terminal.write_line(text)


def prebuild_dir() -> Path:
    return cache_dir() / "prebuild"


def prebuild_running() -> bool:
    """A hack/prebuild.sh runs now (it holds its run.lock)."""
    try:
        with (prebuild_dir() / "run.lock").open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def prebuild_status() -> str:
    """`hack/prebuild.sh status`: built (with times), building, left; or that it has not run here."""
    proc = subprocess.run(["bash", str(HACK_DIR / "prebuild.sh"), "status"], capture_output=True, text=True,
                          timeout=60, check=False)
    return (proc.stdout or proc.stderr).strip()


class PrebuildProgress:
    """The progress file's lines written since this object was made (or since the file was restarted)."""

    def __init__(self, path: Path | None = None):
        self.path = path or prebuild_dir() / "progress"
        self.offset = self._size()

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def new_lines(self) -> list[str]:
        size = self._size()
        if size == self.offset:
            return []
        if size < self.offset:  # a new prebuild started: its file begins again
            self.offset = 0
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self.offset += len(complete)
        return complete.decode(errors="replace").splitlines()


def summary_lines() -> list[str]:
    """The background build's status for the end of the test log, if it ran during this session."""
    return prebuild_status().splitlines() if _SESSION.prebuild_was_running or prebuild_running() else []
