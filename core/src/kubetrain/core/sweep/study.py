"""The Optuna side of a sweep: its sampler and pruner, and the study rebuilt from the sweep's status.

Nothing Optuna holds outlives one policy step: the study is rebuilt in memory from status.trials
(parameters, states, values, intermediate values and the pruner's own bookkeeping), so that the
same status always gives the same decisions, whichever backend or process computes them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.pruners import BasePruner, MedianPruner, NopPruner, SuccessiveHalvingPruner
from optuna.samplers import BaseSampler, GridSampler, RandomSampler, TPESampler
from optuna.trial import FrozenTrial
from optuna.trial import TrialState as OptunaState

from kubetrain.core.api import MAX_INTERMEDIATE_VALUES, TrainingSweepSpec, TrialRecord, TrialState
from kubetrain.core.sweep.space import distributions, grid_values

SEED_STRIDE = 0x9E3779B1
"""Spreads the per-trial sampler seeds (a large odd number: distinct indices never share a seed)."""
STATES = {
    TrialState.PENDING: OptunaState.RUNNING,
    TrialState.RUNNING: OptunaState.RUNNING,
    TrialState.COMPLETE: OptunaState.COMPLETE,
    TrialState.PRUNED: OptunaState.PRUNED,
    TrialState.FAILED: OptunaState.FAIL,
}


def sampler_seed(spec: TrainingSweepSpec, index: int) -> int:
    """The seed of the sampler that chooses trial `index`'s parameters.

    TPE and random: spec.seed mixed with the index, so each trial draws afresh yet the same status
    gives the same parameters. Grid: spec.seed alone, since it fixes the order of the whole grid
    (trial i takes the grid's i-th point).
    """
    if spec.sampler.type == "grid":
        return spec.seed
    return (spec.seed + index * SEED_STRIDE) % 2**32


def sampler(spec: TrainingSweepSpec, seed: int) -> BaseSampler:
    """The Optuna sampler spec.sampler names."""
    kind = spec.sampler.type
    if kind == "grid":
        return GridSampler({p.path: grid_values(p) for p in spec.parameters}, seed=seed)
    if kind == "random":
        return RandomSampler(seed=seed)
    return TPESampler(n_startup_trials=spec.sampler.startup_trials, seed=seed, constant_liar=True)


def min_steps(spec: TrainingSweepSpec) -> int:
    """The step before which no trial is pruned: spec.pruner.minSteps, or a tenth of the template's maxSteps."""
    return spec.pruner.min_steps or max(1, spec.template.spec.max_steps // 10)


def interval(spec: TrainingSweepSpec) -> int:
    """Steps between recorded intermediate values: wide enough that maxSteps fits in MAX_INTERMEDIATE_VALUES."""
    return max(spec.pruner.interval_steps or 1, math.ceil(spec.template.spec.max_steps / MAX_INTERMEDIATE_VALUES))


def pruner(spec: TrainingSweepSpec) -> BasePruner:
    """The Optuna pruner spec.pruner names."""
    kind = spec.pruner.type
    if kind == "asha":
        return SuccessiveHalvingPruner(min_resource=min_steps(spec), reduction_factor=spec.pruner.reduction_factor)
    if kind == "median":
        return MedianPruner(n_startup_trials=spec.pruner.startup_trials, n_warmup_steps=min_steps(spec))
    return NopPruner()


def frozen(spec: TrainingSweepSpec, record: TrialRecord,
           dists: Mapping[str, BaseDistribution] | None = None) -> FrozenTrial:
    """One recorded trial as Optuna holds it (`dists`: distributions(spec), when the caller has them already).

    A Pruned trial without a value is one whose loss diverged (not finite, so not in the status):
    it gets a NaN intermediate value at its last step, as if it had reported it, which TPE ranks
    below every other trial.
    """
    dists = distributions(spec) if dists is None else dists
    state = STATES[record.state]
    value = record.value if state in (OptunaState.COMPLETE, OptunaState.PRUNED) else None
    intermediate = {v.step: v.value for v in record.intermediate}
    if state == OptunaState.PRUNED and value is None:  # no NaN value: Optuna's RDB storage cannot read one back
        intermediate[max([record.step, *intermediate])] = math.nan
    return optuna.trial.create_trial(
        state=state,
        value=value,
        params=dict(record.params),
        distributions={path: dists[path] for path in record.params if path in dists},
        system_attrs=dict(record.pruner_state),
        intermediate_values=intermediate,
    )


def rebuild(spec: TrainingSweepSpec, trials: Sequence[TrialRecord], seed: int) -> optuna.Study:
    """An in-memory study holding every recorded trial in index order (trial number = index).

    Pending and Running trials are RUNNING, so that TPE's constant liar steers new trials away
    from them; Pruned trials keep their last intermediate value as Optuna's own pruned trials do.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # Optuna logs every added trial at INFO
    study = optuna.create_study(direction="minimize", sampler=sampler(spec, seed), pruner=pruner(spec))
    dists = distributions(spec)
    for record in sorted(trials, key=lambda t: t.index):
        study.add_trial(frozen(spec, record, dists))
    return study


def pruner_attrs(trial: FrozenTrial) -> dict[str, float]:
    """The pruner's bookkeeping on a trial (ASHA's `completed_rung_<n>`), kept in TrialRecord.pruner_state."""
    return {k: float(v) for k, v in trial.system_attrs.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def should_prune(study: optuna.Study, index: int) -> tuple[bool, dict[str, float]]:
    """Ask the study's pruner about trial `index` (at its last intermediate value): prune it?, and the
    pruner's bookkeeping on it afterwards (the pruner writes it into the study's storage).

    A rebuilt study's trial numbers are the trials' indices: rebuild adds them in index order, and
    a sweep's indices run from 0 without gaps.
    """
    trial = study.get_trials(deepcopy=False)[index]
    decision = study.pruner.prune(study, trial)
    return decision, pruner_attrs(study.get_trials(deepcopy=False)[index])


def ask(study: optuna.Study, spec: TrainingSweepSpec, seed: int) -> dict[str, Any]:
    """The parameters of the study's next trial, chosen by a sampler with this seed."""
    study.sampler = sampler(spec, seed)
    return dict(study.ask(fixed_distributions=distributions(spec)).params)
