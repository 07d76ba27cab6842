"""The generation fence: a stale gang never commits a checkpoint.

A restarted gang runs beside what is left of the old one whenever the old pods cannot be stopped: a node
partitioned from the API server keeps its containers, and they keep training and saving into the same shared
directory (or bucket). So the durable tier holds one small file, ``GENERATION``: the job run and the newest
generation that started on it. Rank 0 claims it when its gang starts and reads it again just before it
creates a step directory and before it writes ``COMMITTED``; a gang of an older generation of the same run
then stops with StaleGeneration instead of writing. The check and the write that follows are not atomic, so
the fence alone does not keep a frozen gang's late writes out: each gang writes into step directories private
to it and commits by a rename that never replaces a committed directory (directory.py). An old gang that read
the fence a moment before the new gang claimed it may still commit that one step where the new gang has not
yet: a complete checkpoint of its own that resume may load, never a torn one, and never over the new gang's.

A different run (the job deleted and created again with the same storage, or a new local run) takes the
directory over: its first start overwrites the fence, and a gang of the earlier run then finds itself stale.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetrain.core.progress import atomic_write_text

FENCE_FILE = "GENERATION"


class StaleGeneration(RuntimeError):
    """A newer generation, or another run, owns the checkpoints: this gang must not write there."""


@dataclass(frozen=True)
class Fence:
    run: str
    generation: int

    def encode(self) -> str:
        return json.dumps({"run": self.run, "generation": self.generation}) + "\n"


def parse(text: str | None) -> Fence | None:
    """The fence a file holds; None when there is none or it cannot be read (a torn or foreign file: the
    starting gang writes its own over it)."""
    if not text:
        return None
    try:
        raw = json.loads(text)
        return Fence(str(raw["run"]), int(raw["generation"]))
    except (ValueError, KeyError, TypeError):
        return None


def stale_reason(found: Fence | None, mine: Fence) -> str | None:
    """Why a gang of `mine` must not write beside `found`; None when it may."""
    if found is None or found == mine:
        return None
    if found.run != mine.run:
        return f"another run ({found.run}, generation {found.generation}) has taken the checkpoints over"
    if found.generation > mine.generation:
        return f"generation {found.generation} of this job has started since"
    return None


@dataclass
class GenerationFence:
    """Rank 0's fence on one durable tier, through `read` and `write` of the fence file's text."""

    mine: Fence | None
    """This gang's run and generation; None: no run id (a custom launcher), nothing is fenced."""
    read: Callable[[], str | None]
    write: Callable[[str], Any]

    def claim(self) -> None:
        """At the gang's start: the fence names this gang from now on. Raises StaleGeneration when a newer
        generation of the same run started already."""
        if self.mine is None:
            return
        found = parse(self.read())
        if found is not None and found.run == self.mine.run and found.generation > self.mine.generation:
            self.check(found)
        if found != self.mine:
            self.write(self.mine.encode())

    def check(self, found: Fence | None = None, what: str = "start") -> None:
        """Before writing into the durable tier: raises StaleGeneration when this gang is stale."""
        if self.mine is None:
            return
        found = found if found is not None else parse(self.read())
        if (why := stale_reason(found, self.mine)) is not None:
            raise StaleGeneration(f"not writing checkpoints ({what}): this gang is generation "
                                  f"{self.mine.generation} and {why}; a stale worker stops here")


def on_directory(root: Path, mine: Fence | None) -> GenerationFence:
    path = root / FENCE_FILE

    def read() -> str | None:
        try:
            return path.read_text()
        except FileNotFoundError:
            return None

    def write(text: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)

    return GenerationFence(mine, read, write)
