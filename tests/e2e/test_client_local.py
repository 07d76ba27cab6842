"""kubetrain.client's LocalClient: jobs run as background `kubetrain run`s of a user's script (no torch),
driven through the same calls as on a cluster: submit -> wait with progress, a failure's reason,
suspend -> resume -> Succeeded from the checkpoint, logs, events, delete."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from support.waiting import wait_for

from kubetrain.client import Conflict, JobFailed, LocalClient, NotFound, ProgressUpdate

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent


def job(name: str, steps: int, **env: str) -> dict[str, Any]:
    variables = [{"name": "SCRIPT_MAX_STEPS", "value": str(steps)}] + [{"name": k, "value": v} for k, v in env.items()]
    return {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name, "labels": {"t": name}},
            "spec": {"workers": 2, "maxSteps": steps, "command": [sys.executable, str(HERE / "script_worker.py")],
                     "env": variables, "restartPolicy": {"backoffLimit": 1, "backoffSeconds": 0.2},
                     "metricsPort": 19500}}


@pytest.fixture()
def kt(tmp_path: Path) -> LocalClient:
    return LocalClient(tmp_path / "runs", poll_seconds=0.2)


def test_submit_wait_succeeded_with_progress_then_delete(kt: LocalClient) -> None:
    kt.submit(job("tiny", 40))
    with pytest.raises(Conflict, match="exists"):
        kt.submit(job("tiny", 40))
    seen: list[ProgressUpdate] = []
    done = kt.wait("tiny", timeout=120, on_progress=seen.append)
    assert done.status is not None and (done.status.phase, done.status.current_step) == ("Succeeded", 40), seen
    running = [u for u in seen if u.phase == "Running"]
    assert running and all(u.loss is not None and u.max_steps == 40 for u in running), seen
    assert [u.step for u in running] == sorted(u.step for u in running), seen
    assert done.status.loss == "0.2500" and done.status.last_checkpoint is not None
    assert [j.metadata.name for j in kt.list("t=tiny")] == ["tiny"] and kt.list({"t": "other"}) == []
    assert [w.index for w in kt.workers("tiny")] == [0, 1]
    assert isinstance(kt.logs("tiny", rank=1), str)
    kt.delete("tiny")
    assert not (kt.root / "tiny").exists()
    with pytest.raises(NotFound):
        kt.get("tiny")


def test_a_failed_local_job_raises_its_reason(kt: LocalClient) -> None:
    kt.submit(job("broken", 40, SCRIPT_EXIT_STEP="3", SCRIPT_EXIT_CODE="2"))  # 2: a permanent exit code
    with pytest.raises(JobFailed) as caught:
        kt.wait("broken", timeout=120)
    assert caught.value.reason == "PermanentError", caught.value
    assert "exit code 2" in str(caught.value) or "code 2" in caught.value.message, caught.value
    assert any(e.reason == "PermanentError" for e in kt.events("broken")), kt.events("broken")


def test_suspend_then_resume_finishes_from_the_checkpoint(kt: LocalClient) -> None:
    kt.submit(job("pause", 200))
    kt.wait("pause", until="Running", timeout=60)
    wait_for(lambda: (st := kt.get("pause").status) is not None and st.current_step >= 8, 60, what="step 8")
    assert kt.suspend("pause").spec.suspend is True
    suspended = kt.wait("pause", until="Suspended", timeout=60)
    assert suspended.status is not None and suspended.status.reason == "Interrupted", suspended.status
    assert kt.resume("pause").spec.suspend is False
    done = kt.wait("pause", timeout=120)
    assert done.status is not None and done.status.phase == "Succeeded" and done.status.current_step == 200
    assert "resuming the unfinished run" in (kt.root / ".client" / "pause" / "run.log").read_text()
