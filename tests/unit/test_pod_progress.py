"""Rank 0's pod-annotation reporter against a local HTTP stub of the API server's pod PATCH.

What the stub cannot show (TLS, the token, RBAC, the operator reading it) is covered on the real
control plane by tests/integration/test_progress_reporting.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kubetrain.core import contract
from kubetrain.core.progress import CheckpointRecord, Progress, read_progress, write_progress
from kubetrain.trainer.observe import progress as pp


class Stub:
    """Records PATCHes; `status`, `delay` and `message` shape the next answers."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.status = 200
        self.delay = 0.0
        self.message = ""
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_PATCH(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(stub.delay)
                stub.requests.append({"path": self.path, "headers": dict(self.headers), "body": json.loads(body),
                                      "at": time.monotonic()})
                reply = json.dumps({"kind": "Status", "message": stub.message} if stub.status >= 400 else {}).encode()
                try:
                    self.send_response(stub.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                except OSError:
                    pass  # the client timed out and hung up

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def steps(self) -> list[int]:
        return [json.loads(r["body"]["metadata"]["annotations"][contract.PROGRESS_ANNOTATION])["step"]
                for r in self.requests]


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.server.shutdown()
    s.server.server_close()


@pytest.fixture
def pod_env(stub: Stub, tmp_path: Path) -> dict[str, str]:
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    return {contract.POD_NAME: "llm-worker-0", contract.POD_NAMESPACE: "team-a", pp.API_SERVER_ENV: stub.url,
            pp.TOKEN_FILE_ENV: str(token), pp.CA_FILE_ENV: ""}


def target(env: dict[str, str]) -> pp.PodTarget:
    t, why = pp.target_from_env(env)
    assert t is not None, why
    return t


def wait(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_target_only_in_a_pod(tmp_path: Path) -> None:
    t, why = pp.target_from_env({})
    assert t is None and contract.POD_NAME in why
    token = tmp_path / "token"
    token.write_text("x")
    env = {contract.POD_NAME: "j-worker-0", contract.POD_NAMESPACE: "ns", pp.TOKEN_FILE_ENV: str(token)}
    t, why = pp.target_from_env(env)
    assert t is None and "KUBERNETES_SERVICE_HOST" in why
    t, _ = pp.target_from_env({**env, "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert t is not None and t.url == "https://10.96.0.1:443/api/v1/namespaces/ns/pods/j-worker-0"
    t, _ = pp.target_from_env({**env, "KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"})
    assert t is not None and t.url.startswith("https://[fd00::1]:6443/")
    t, why = pp.target_from_env({**env, "KUBERNETES_SERVICE_HOST": "h", pp.TOKEN_FILE_ENV: str(tmp_path / "none")})
    assert t is None and "token" in why
    t, why = pp.target_from_env({**env, "KUBERNETES_SERVICE_HOST": "h", pp.CA_FILE_ENV: str(tmp_path / "no.crt")})
    assert t is None and "no.crt" in why


def test_merge_patch_of_the_annotation_with_the_bearer_token(stub: Stub, pod_env: dict[str, str]) -> None:
    r = pp.PodProgressReporter(target(pod_env), interval=60)
    prog = Progress(job="llm", step=7, loss=2.5, last_checkpoint=CheckpointRecord(step=5, path="/c/step-5", time="t"))
    r.report(prog, force=True)
    assert r.close()
    (req,) = stub.requests
    assert req["path"] == "/api/v1/namespaces/team-a/pods/llm-worker-0"
    assert req["headers"]["Content-Type"] == "application/merge-patch+json"
    assert req["headers"]["Authorization"] == "Bearer secret-token"
    sent = req["body"]["metadata"]["annotations"][contract.PROGRESS_ANNOTATION]
    assert Progress.model_validate_json(sent) == prog  # the same record as progress.json
    assert list(req["body"]) == ["metadata"] and list(req["body"]["metadata"]) == ["annotations"]


def test_throttled_newest_wins_forced_at_once(stub: Stub, pod_env: dict[str, str]) -> None:
    # An interval long beside any scheduling delay of a loaded machine: "at once" and "after the interval"
    # stay apart by seconds.
    r = pp.PodProgressReporter(target(pod_env), interval=3.0)
    r.report(Progress(step=1), force=True)  # first step: at once
    wait(lambda: len(stub.requests) == 1)
    for step in range(2, 30):  # many steps within one interval: one PATCH, with the newest
        r.report(Progress(step=step))
    time.sleep(0.2)
    assert stub.steps() == [1]
    wait(lambda: len(stub.requests) == 2, timeout=10)
    assert stub.steps() == [1, 29]
    assert stub.requests[1]["at"] - stub.requests[0]["at"] >= 2.9
    r.report(Progress(step=30, last_checkpoint=CheckpointRecord(step=30, path="p", time="t")), force=True)
    wait(lambda: len(stub.requests) == 3)  # a checkpoint commit does not wait for the interval
    assert stub.requests[2]["at"] - stub.requests[1]["at"] < 2.0
    r.report(Progress(step=31, finished=True))
    assert r.close()  # the last record goes out at close, not after the interval
    assert stub.steps() == [1, 29, 30, 31]


def test_slow_api_server_never_blocks_training_and_warns_once(
    stub: Stub, pod_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    stub.delay = 5.0  # far beyond every bound below: a report() or close() that waited for it would show
    r = pp.PodProgressReporter(target(pod_env), interval=0.05, timeout=0.2)
    caplog.set_level(logging.DEBUG, logger="kubetrain.trainer.progress")
    longest = 0.0
    for step in range(1, 200):
        t0 = time.monotonic()
        r.report(Progress(step=step), force=step % 10 == 0)
        longest = max(longest, time.monotonic() - t0)
        time.sleep(0.005)
    assert longest < 1.0, f"report() waited for the API server ({longest:.2f}s)"
    wait(lambda: r.failures >= 2)
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "training goes on" in warnings[0].getMessage()
    t1 = time.monotonic()
    assert not r.close(timeout=1.0)
    assert time.monotonic() - t1 < 3.0, "close() is bounded by its timeout, not by the API server"


def test_refused_then_allowed_retries_the_kept_record(
    stub: Stub, pod_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """403 (e.g. the Role is not there yet): the record is kept and sent at the next interval."""
    stub.status, stub.message = 403, 'pods "llm-worker-0" is forbidden: User "x" cannot patch resource "pods"'
    r = pp.PodProgressReporter(target(pod_env), interval=0.3)
    caplog.set_level(logging.INFO, logger="kubetrain.trainer.progress")
    r.report(Progress(step=3), force=True)
    wait(lambda: r.failures >= 1)
    assert r.last_error is not None and "HTTP 403" in r.last_error and "cannot patch" in r.last_error
    stub.status = 200
    wait(lambda: r.sent == 1)
    # The refused attempt(s), then the accepted one: a loaded machine may retry more than once first.
    assert stub.steps()[-1] == 3 and set(stub.steps()) == {3} and len(stub.steps()) >= 2 and r.last_error is None
    assert any("works again" in rec.getMessage() for rec in caplog.records)
    assert r.close()


def test_annotation_keeps_only_the_newest_checkpoints() -> None:
    value = pp.annotation_value(Progress(step=9000, checkpoints=list(range(50, 9050, 50))))
    assert json.loads(value)["checkpoints"] == list(range(8250, 9050, 50))
    assert len(json.loads(value)["checkpoints"]) == pp.MAX_CHECKPOINTS_IN_ANNOTATION


def test_cli_exit_codes(stub: Stub, pod_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in pod_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(contract.RESTART_GENERATION, "2")
    monkeypatch.setenv(contract.JOB, "llm")
    assert pp.main(["--step", "12", "--loss", "1.5", "--checkpoint-step", "10", "--checkpoint-path", "/c/10"]) == 0
    sent = Progress.model_validate_json(stub.requests[0]["body"]["metadata"]["annotations"][contract.PROGRESS_ANNOTATION])
    assert (sent.job, sent.generation, sent.step, sent.loss) == ("llm", 2, 12, 1.5)
    assert sent.last_checkpoint is not None and (sent.last_checkpoint.step, sent.last_checkpoint.path) == (10, "/c/10")
    stub.status, stub.message = 403, "forbidden"
    assert pp.main(["--step", "13"]) == 1
    assert set(stub.steps()) == {12, 13}  # 13 refused (and, on a loaded machine, tried again before close() ended)
    sent_before = len(stub.requests)
    monkeypatch.delenv(contract.POD_NAME)
    assert pp.main(["--step", "14"]) == 0  # a local run: nothing to annotate, not an error
    assert len(stub.requests) == sent_before


def test_report_progress_helper_rank_0_only_and_writes_progress_json(
    stub: Stub, pod_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for k, v in pod_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(contract.OUTPUT_DIR, str(tmp_path / "out"))
    monkeypatch.setattr(pp, "_script", None)
    monkeypatch.setenv(contract.RANK, "1")
    assert pp.report_progress(5) is False and not stub.requests
    monkeypatch.setenv(contract.RANK, "0")
    assert pp.report_progress(5, loss=2.0, max_steps=10) is True
    assert pp.report_progress(10, loss=1.0, checkpoint_step=10, checkpoint_path="/c/10", finished=True)
    assert pp._script is not None and pp._script.pod is not None
    assert pp._script.pod.close()
    assert stub.steps()[-1] == 10
    on_disk = json.loads((tmp_path / "out" / contract.PROGRESS_FILE).read_text())
    assert on_disk["step"] == 10 and on_disk["finished"] is True and on_disk["lastCheckpoint"]["step"] == 10


def test_trainer_reporter_annotates_when_in_a_pod(
    stub: Stub, pod_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """loop.Reporter (rank 0 of the built-in trainer) sends the progress.json record to the pod."""
    loop = pytest.importorskip("kubetrain.trainer.loop")
    from kubetrain.core.api import TrainingJobSpec  # noqa: PLC0415
    from kubetrain.trainer.checkpoint.directory import TrainerState  # noqa: PLC0415
    from kubetrain.trainer.config import read_env  # noqa: PLC0415

    for k, v in pod_env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "out"
    env = read_env({contract.RANK: "0", contract.WORLD_SIZE: "1", contract.CONFIG: "c.json",
                    contract.OUTPUT_DIR: str(out), contract.JOB: "llm", contract.RESTART_GENERATION: "1"})
    rep = loop.Reporter(env, TrainingJobSpec(max_steps=3), tmp_path / "ck")
    assert rep.pod is not None
    state = TrainerState(world_size=1, strategy="ddp")
    for step in (1, 2, 3):
        state.step = step
        rep.step({"step": step, "loss": 3.0 - step, "tokens_per_second": 1.0}, state, loop.Rates(1.0, 0.5, 0.25),
                 force=step == 1)
        if step == 1:  # the first step is forced out at once; later ones may coalesce into the newest
            wait(lambda: len(stub.requests) == 1)
    rep.checkpoint(state, tmp_path / "ck" / "step-00000003", 0.1)
    rep.progress.finished = True
    rep.write(True)
    rep.close()
    last = Progress.model_validate_json(stub.requests[-1]["body"]["metadata"]["annotations"][contract.PROGRESS_ANNOTATION])
    assert last == Progress.model_validate_json((out / contract.PROGRESS_FILE).read_text())
    assert (last.step, last.generation, last.finished, last.last_checkpoint.step) == (3, 1, True, 3)
    assert (last.tokens_per_second, last.step_seconds, last.mfu) == (1.0, 0.5, 0.25)
    assert stub.steps()[0] == 1 and stub.steps() == sorted(stub.steps())


@pytest.mark.parametrize("error", [None, RuntimeError("Connection closed by peer")])
def test_a_training_error_puts_out_the_steps_the_throttle_held(tmp_path: Path, error: Exception | None) -> None:
    """Steps trained after the last record count as lost when the gang restarts, so an error ending the
    loop writes the newest step out; a loop left normally writes nothing it was not asked to."""
    loop = pytest.importorskip("kubetrain.trainer.loop")
    from kubetrain.core.api import TrainingJobSpec  # noqa: PLC0415
    from kubetrain.trainer.checkpoint.directory import TrainerState  # noqa: PLC0415
    from kubetrain.trainer.config import read_env  # noqa: PLC0415

    out = tmp_path / "out"
    env = read_env({contract.RANK: "0", contract.WORLD_SIZE: "2", contract.CONFIG: "c.json",
                    contract.OUTPUT_DIR: str(out), contract.JOB: "llm"})
    state = TrainerState(world_size=2, strategy="ddp")
    with contextlib.suppress(RuntimeError), loop.Reporter(env, TrainingJobSpec(max_steps=60), tmp_path / "ck") as rep:
        for step in range(1, 11):  # one forced record, then nine inside the one-second throttle
            state.step = step
            rep.step({"step": step, "loss": 1.0, "tokens_per_second": 1.0}, state, loop.Rates(1.0, 0.01, None),
                     force=step == 1)
        if error is not None:
            raise error
    assert read_progress(out).step == (1 if error is None else 10)
    assert rep.losses is None  # closed either way


def test_a_diverged_loss_survives_the_record_so_readers_see_it(tmp_path):
    """NaN is written as JSON's NaN and read back: a record with it is not refused (sweeps prune on it)."""
    write_progress(tmp_path, Progress(job="j", step=7, loss=float("nan")))
    back = read_progress(tmp_path)
    assert back is not None and back.step == 7 and back.loss is not None and math.isnan(back.loss)
    assert math.isnan(Progress.model_validate_json(Progress(loss=float("inf") * 0).model_dump_json()).loss)
