"""`kubetrain status` / `describe` of a TrainingSweep: its phase, the trials table by the objective's metric,
and (describe) each trial's outcome and the best trial's job."""

from __future__ import annotations

from kubetrain.core.api import TrainingSweep
from kubetrain.core.kube_cli import sweep_lines

SWEEP = TrainingSweep.model_validate({
    "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "lr", "namespace": "ml"},
    "spec": {"template": {"spec": {"maxSteps": 100, "evalEverySteps": 10}}, "maxTrials": 2,
             "objective": {"metric": "evalLoss"},
             "parameters": [{"path": "optimizer.lr", "type": "float", "low": 1e-4, "high": 1e-2}]},
    "status": {"phase": "Succeeded", "reason": "Completed", "message": "best evalLoss 1.5 by trial 1",
               "bestTrial": 1, "bestValue": 1.5, "bestParams": {"optimizer.lr": 0.003}, "trials": [
                   {"index": 0, "jobName": "lr-0", "params": {"optimizer.lr": 0.01}, "state": "Complete",
                    "value": 2.0, "step": 100, "message": "final evalLoss 2 at step 100"},
                   {"index": 1, "jobName": "lr-1", "params": {"optimizer.lr": 0.003}, "state": "Complete",
                    "value": 1.5, "step": 100, "message": "final evalLoss 1.5 at step 100"}]}})


def test_status_of_a_sweep_shows_its_trials_by_the_objective_and_marks_the_best() -> None:
    lines = sweep_lines(SWEEP)
    assert lines[:4] == ["Name:        lr", "Namespace:   ml", "Phase:       Succeeded (Completed)",
                         "Message:     best evalLoss 1.5 by trial 1"]
    assert lines[5].split() == ["#", "params", "step", "evalLoss", "state"]
    assert lines[7].split() == ["1", "optimizer.lr=0.003", "100/100", "1.5000", "Complete", "*"]


def test_describe_of_a_sweep_adds_each_outcome_and_the_best_job() -> None:
    lines = sweep_lines(SWEEP, describe=True)
    assert "  trial 0 (lr-0): final evalLoss 2 at step 100" in lines
    assert lines[-1] == "Best:        trial 1, job lr-1 (`kubetrain describe lr-1`)"
