"""The preflight's report into status, its verdict as the NodeDegraded condition, and the nodes to avoid."""

from __future__ import annotations

from datetime import datetime

from kubetrain.core.api import NODE_DEGRADED, Condition, ConditionReason, TrainingJobSpec, TrainingJobStatus
from kubetrain.core.lifecycle.model import Observed, RecordEvent
from kubetrain.core.lifecycle.status import set_condition
from kubetrain.core.preflight import degraded_nodes, degraded_ranks, verdict_message


def preflight_condition(
    spec: TrainingJobSpec, status: TrainingJobStatus, observed: Observed, conds: list[Condition], now: datetime
) -> tuple[list[Condition], RecordEvent | None]:
    """The current generation's preflight (rank 0's progress record) into status.preflight with its verdict.

    NodeDegraded=True names every degraded rank, with one Warning Event as it turns True or names others;
    False (PreflightPassed) once a later generation's preflight finds none; absent until one is found.
    With restartPolicy.avoidDegradedNodes, their nodes join status.avoidedNodes (later pods avoid them)."""
    report = observed.progress.preflight if observed.progress is not None else None
    if report is None or report.generation != status.restart_generation:
        return conds, None
    fraction = spec.preflight.degraded_fraction
    found = degraded_ranks(report, fraction)
    status.preflight = report.model_copy(update={"degraded_ranks": [d.rank for d in found]})
    raw = [c.dump() for c in conds]
    if not found:
        raw = set_condition(raw, NODE_DEGRADED, False, ConditionReason.PREFLIGHT_PASSED,
                            f"preflight of generation {report.generation}: no rank below {fraction:g} of the "
                            "gang's median", now)
        return [Condition.model_validate(c) for c in raw], None
    message = verdict_message(found, fraction, report.generation)
    seen = any(c.get("type") == NODE_DEGRADED and c.get("status") == "True" and c.get("message") == message
               for c in raw)
    raw = set_condition(raw, NODE_DEGRADED, True, ConditionReason.RANK_DEGRADED, message, now)
    if spec.restart_policy.avoid_degraded_nodes:
        status.avoided_nodes = list(dict.fromkeys([*status.avoided_nodes, *degraded_nodes(found)]))
    event = None if seen else RecordEvent("Warning", ConditionReason.RANK_DEGRADED, message)
    return [Condition.model_validate(c) for c in raw], event
