"""The local directories kubetrain writes into, and the one rule for deleting anything there.

kubetrain deletes only what it wrote. A directory it uses (a run's output directory, its
checkpoint directory, a sweep's output directory) carries contract.OWNED_DIR_MARKER from the
moment kubetrain created it or adopted it empty. Starting over clears the contents of such a
directory, never the directory itself, and never a directory without the marker. A directory
that already holds anything else is refused before a process starts, naming the field and a few
of the files, so that a mistyped path can never cost a user their files.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from kubetrain.core import contract

MARKER = contract.OWNED_DIR_MARKER
SHOWN_ENTRIES = 5
"""How many foreign entries a refusal names."""
_TEMP_FILE = re.compile(r"^\..+\.tmp$")
"""progress.atomic_write_text's temp files, left behind by a write cut off mid-way."""

EntryTest = Callable[[str], bool]


class NotOwnedError(Exception):
    """kubetrain will not use (or clear) this directory; the message names the field and why."""


def names(*fixed: str, pattern: str | None = None) -> EntryTest:
    """A test for the entries a kubetrain release wrote into a directory before it carried the marker:
    these exact names, names matching `pattern`, and atomic writes' temp files."""
    regex = re.compile(pattern) if pattern else None
    return lambda name: name in fixed or bool(regex and regex.match(name)) or bool(_TEMP_FILE.match(name))


def _nothing(name: str) -> bool:
    return False


def owned(path: Path) -> bool:
    return (path / MARKER).is_file()


def claim(path: Path, field: str, written_before: EntryTest = _nothing) -> None:
    """Make `path` a directory kubetrain owns: create it, or adopt it when it holds nothing but what
    `written_before` recognises as kubetrain's own (an output of a release without the marker)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NotOwnedError(f"{field}: cannot create {path}: {exc.strerror or exc}") from None
    if not path.is_dir():
        raise NotOwnedError(f"{field}: {path} is not a directory")
    if owned(path):
        return
    try:
        foreign = sorted(e.name for e in path.iterdir() if not written_before(e.name))
    except OSError as exc:
        raise NotOwnedError(f"{field}: cannot list {path}: {exc.strerror or exc}") from None
    if foreign:
        raise NotOwnedError(_foreign_message(path, field, foreign))
    try:
        (path / MARKER).write_text("This directory was created by kubetrain; a fresh run clears its contents.\n")
    except OSError as exc:
        raise NotOwnedError(f"{field}: {path} is not writable: {exc.strerror or exc}") from None


def _foreign_message(path: Path, field: str, foreign: list[str]) -> str:
    shown = ", ".join(foreign[:SHOWN_ENTRIES]) + (f" and {len(foreign) - SHOWN_ENTRIES} more"
                                                   if len(foreign) > SHOWN_ENTRIES else "")
    return (f"{field}: {path} already holds files kubetrain did not write ({shown}); kubetrain writes into "
            "and clears only directories it created: name a new or empty directory")


def clear(path: Path, only: Iterable[str] | None = None) -> None:
    """Delete the contents of a directory kubetrain owns (the entries named in `only`, else all but the
    marker). A symlink is removed, never followed. Deleting in a directory without the marker raises."""
    if not path.exists():
        return
    if not owned(path):
        raise NotOwnedError(f"{path} was not created by kubetrain: nothing in it is deleted")
    entries = [path / n for n in only] if only is not None else [e for e in path.iterdir() if e.name != MARKER]
    for entry in entries:
        if entry.is_symlink() or (entry.exists() and not entry.is_dir()):
            entry.unlink()
        elif entry.is_dir():
            shutil.rmtree(entry)
