"""The live output of a local sweep: the trials table redrawn in place on a terminal, one line per
trial state change otherwise, and the sweep's events in both cases."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from typing import IO

from kubetrain.core.api import SweepReason, TrainingSweepSpec, TrainingSweepStatus, TrialState
from kubetrain.core.sweep import report
from kubetrain.core.sweep.model import SweepEvent

UP_AND_CLEAR = "\033[{n}F\033[J"
"""Cursor to the start of the line n lines up, then clear to the end of the screen."""
TRIAL_END_REASONS = (SweepReason.TRIAL_COMPLETED, SweepReason.TRIAL_PRUNED, SweepReason.TRIAL_FAILED)


class SweepView:
    """Writes to `stream` (stderr): the table on a TTY, state-change lines elsewhere, nothing live when quiet."""

    def __init__(self, stream: IO[str], name: str, spec: TrainingSweepSpec, quiet: bool = False):
        self.stream, self.name, self.spec, self.quiet = stream, name, spec, quiet
        self.tty = stream.isatty()
        self.drawn: list[str] = []
        """The table lines on the screen now (TTY)."""
        self.states: dict[int, TrialState] = {}

    def say(self, text: str) -> None:
        """A line above the table (the table is drawn again on the next update)."""
        self._erase()
        self.stream.write(text + "\n")
        self.stream.flush()

    def event(self, event: SweepEvent) -> None:
        """Every event, but a trial's end when its state-change line says it (with its duration) instead."""
        if not self.quiet and not self.tty and event.reason in TRIAL_END_REASONS:
            return
        self.say(f"{'warning: ' if event.type == 'Warning' else ''}{event.reason}: {event.message}")

    def update(self, status: TrainingSweepStatus, live: Mapping[int, float | None]) -> None:
        if self.quiet:
            return
        if self.tty:
            self._draw(report.table(self.name, self.spec, status, live))
            return
        for trial in status.trials:
            if self.states.get(trial.index) != trial.state:
                self.states[trial.index] = trial.state
                line = report.change_line(trial)
                if line is not None:
                    self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, status: TrainingSweepStatus, live: Mapping[int, float | None]) -> None:
        """The last table (or lines) stays on the screen."""
        self.update(status, live)
        self.drawn = []

    def _draw(self, lines: list[str]) -> None:
        width = shutil.get_terminal_size().columns
        lines = [ln if len(ln) < width else ln[: width - 1] for ln in lines]  # a wrapped line breaks the redraw
        if lines == self.drawn:
            return
        self._erase()
        self.stream.write("".join(ln + "\n" for ln in lines))
        self.stream.flush()
        self.drawn = lines

    def _erase(self) -> None:
        if self.tty and self.drawn:
            self.stream.write(UP_AND_CLEAR.format(n=len(self.drawn)))
            self.drawn = []
