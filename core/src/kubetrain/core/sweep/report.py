"""What a local sweep shows: the trials table, one line per trial state change, and the time comparison.

Pure: every function takes the sweep's status (and what the runner observed) and returns text,
so the table and the estimate are tested without processes or a terminal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubetrain.core.api import FINISHED_TRIAL_STATES, TrainingSweepSpec, TrainingSweepStatus, TrialRecord, TrialState
from kubetrain.core.contract import format_duration, parse_time

PARAMS_WIDTH = 48
"""Widest params column: beyond it the column is cut with `...` so that a row stays on one line."""


def format_value(value: Any) -> str:
    """A parameter value or a loss, short: 3 significant digits for floats (1.23e-04, 0.0312, 512)."""
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.2e}"
    return f"{value:.3g}"


def format_params(params: Mapping[str, Any]) -> str:
    """`optimizer.lr=0.00312 microBatchSize=8`, in the order the sweep lists its parameters."""
    return " ".join(f"{path}={format_value(v)}" for path, v in params.items())


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def header(name: str, spec: TrainingSweepSpec, status: TrainingSweepStatus) -> str:
    """`sweep lr: 3/8 done | running 2 | pruned 1 | failed 0 | best #2 2.1034 (optimizer.lr=0.00312)`."""
    done = sum(1 for t in status.trials if t.state in FINISHED_TRIAL_STATES)
    best = "best -"
    if status.best_trial is not None:
        best = f"best #{status.best_trial} {_loss(status.best_value)} ({format_params(status.best_params or {})})"
    return (f"sweep {name}: {done}/{spec.max_trials} done | running {status.trials_running} | "
            f"pruned {status.trials_pruned} | failed {status.trials_failed} | {best}")


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def trial_loss(record: TrialRecord, live: Mapping[int, float | None]) -> float | None:
    """The loss to show: the objective once a trial ended, else the latest one the runner saw."""
    if record.state in FINISHED_TRIAL_STATES and record.value is not None:
        return record.value
    seen = live.get(record.index)
    if seen is not None:
        return seen
    return record.intermediate[-1].value if record.intermediate else None


def table(name: str, spec: TrainingSweepSpec, status: TrainingSweepStatus,
          live: Mapping[int, float | None] | None = None) -> list[str]:
    """The header, then one row per trial: index, params, step/maxSteps, loss, state (best marked `*`)."""
    live = live or {}
    max_steps = spec.template.spec.max_steps
    rows = [(str(t.index), _cut(format_params(t.params), PARAMS_WIDTH), f"{t.step}/{max_steps}",
             _loss(trial_loss(t, live)), t.state.value + (" *" if t.index == status.best_trial else ""))
            for t in status.trials]
    titles = ("#", "params", "step", spec.objective.metric, "state")
    widths = [max([len(titles[i])] + [len(r[i]) for r in rows]) for i in range(len(titles))]
    lines = [header(name, spec, status), "  ".join(t.ljust(w) for t, w in zip(titles, widths, strict=True)).rstrip()]
    for r in rows:
        cells = [r[0].rjust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]), r[3].rjust(widths[3]), r[4]]
        lines.append("  ".join(cells))
    return lines


def change_line(record: TrialRecord) -> str | None:
    """One line for a trial that changed state (the output when stderr is not a terminal); None for
    Pending, which a local trial leaves at once."""
    head = f"trial {record.index} {record.state.value}"
    if record.state == TrialState.PENDING:
        return None
    if record.state == TrialState.RUNNING:
        return f"{head}: {format_params(record.params)}"
    took = trial_seconds(record)
    after = f" after {format_duration(took)}" if took is not None else ""
    return f"{head}{after}: {record.message or f'loss {_loss(record.value)} at step {record.step}'}"


def trial_seconds(record: TrialRecord) -> float | None:
    """Wall time of a finished trial, from its recorded start and completion."""
    start, end = parse_time(record.start_time), parse_time(record.completion_time)
    return (end - start).total_seconds() if start is not None and end is not None else None


@dataclass(frozen=True)
class Timing:
    """The sweep's wall time against what its trials would take had none been pruned."""

    sweep_seconds: float
    trials: int
    parallelism: int
    mean_complete_seconds: float | None
    """Mean wall time of the trials that ran to maxSteps (None when none did)."""

    @property
    def unpruned_seconds(self) -> float | None:
        """The same number of trials, each as long as a complete one, `parallelism` at a time."""
        if self.mean_complete_seconds is None:
            return None
        return self.mean_complete_seconds * self.trials / self.parallelism

    def lines(self) -> list[str]:
        took = f"sweep wall time: {format_duration(self.sweep_seconds)}" + (
            f" ({self.sweep_seconds:.1f}s)" if self.sweep_seconds >= 60 else "")
        unpruned = self.unpruned_seconds
        if unpruned is None or self.mean_complete_seconds is None:
            return [took, "no trial ran to maxSteps: no estimate of the time without pruning"]
        saved = 1 - self.sweep_seconds / unpruned if unpruned > 0 else 0.0
        return [took, f"without pruning: ~{format_duration(unpruned)} ({self.mean_complete_seconds:.1f}s per complete "
                      f"trial x {self.trials} trials / parallelism {self.parallelism} = {unpruned:.1f}s); "
                      + (f"{saved:.0%} saved" if saved > 0 else "no time saved")]


def timing(spec: TrainingSweepSpec, status: TrainingSweepStatus, sweep_seconds: float) -> Timing:
    """The time comparison of a finished (or stopped) sweep."""
    complete = [s for t in status.trials if t.state == TrialState.COMPLETE and (s := trial_seconds(t)) is not None]
    mean = sum(complete) / len(complete) if complete else None
    return Timing(sweep_seconds, len(status.trials), spec.parallelism, mean)


def sweep_seconds(status: TrainingSweepStatus) -> float | None:
    """The sweep's wall time from its recorded start and completion (a resumed sweep counts its pause)."""
    start, end = parse_time(status.start_time), parse_time(status.completion_time)
    return (end - start).total_seconds() if start is not None and end is not None else None
