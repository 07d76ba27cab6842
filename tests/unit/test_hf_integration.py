"""kubetrain.integrations.transformers without training: the commit rule, the resume helper, the log mapping,
and the callback's hooks driven by hand (one process, no process group)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from kubetrain.core import contract
from kubetrain.core.cli import main
from kubetrain.core.progress import COMMIT_MARKER, committed_checkpoints, committed_hf_checkpoints, read_progress
from kubetrain.integrations import transformers as kt
from kubetrain.trainer.observe import progress as observe_progress


@pytest.fixture
def reporting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Rank 0 of generation 2, reporting to progress.json in a fresh output directory."""
    out = tmp_path / "out"
    out.mkdir()
    for var in (contract.POD_NAME, contract.POD_NAMESPACE, contract.HEARTBEAT_DIR, contract.FAIL_AT):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(contract.OUTPUT_DIR, str(out))
    monkeypatch.setenv(contract.RANK, "0")
    monkeypatch.setenv(contract.RESTART_GENERATION, "2")
    monkeypatch.setattr(observe_progress, "_script", None)  # a reporter for this output directory
    handlers = {sig: signal.getsignal(sig) for sig in kt.STOP_SIGNALS}
    yield out
    for sig, handler in handlers.items():  # a callback left installed by a test ends with it
        signal.signal(sig, handler)


def checkpoint(root: Path, name: str, committed: bool) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    if committed:
        (path / COMMIT_MARKER).write_text("{}")
    return path


def test_only_committed_checkpoint_folders_count(tmp_path):
    checkpoint(tmp_path, "checkpoint-5", True)
    checkpoint(tmp_path, "checkpoint-10", True)
    checkpoint(tmp_path, "checkpoint-15", False)  # a save cut off by a kill
    checkpoint(tmp_path, "checkpoint-x", True)
    checkpoint(tmp_path, "step-00000020", True)  # the built-in trainer's layout
    assert [s for s, _ in committed_hf_checkpoints(tmp_path)] == [5, 10]
    assert [s for s, _ in committed_checkpoints(tmp_path)] == [5, 10, 20]
    assert committed_hf_checkpoints(tmp_path / "missing") == []


def test_commit_checkpoint_writes_the_marker_last_and_whole(tmp_path):
    path = checkpoint(tmp_path, "checkpoint-7", False)
    kt.commit_checkpoint(path, 7, 4)
    marker = json.loads((path / COMMIT_MARKER).read_text())
    assert (marker["step"], marker["worldSize"], marker["format"]) == (7, 4, "transformers")
    assert [p.name for p in path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_resume_checkpoint_picks_the_newest_committed_and_reports_it(tmp_path, reporting):
    ckpt = tmp_path / "ckpt"
    assert kt.resume_checkpoint(ckpt) is None  # a fresh start
    checkpoint(ckpt, "checkpoint-9", True)
    newest = checkpoint(ckpt, "checkpoint-20", True)
    checkpoint(ckpt, "checkpoint-30", False)
    assert kt.resume_checkpoint(ckpt) == str(newest)
    progress = read_progress(reporting)
    assert progress is not None
    assert (progress.step, progress.resumed_from, progress.resumed_tier, progress.generation) == (20, 20, "durable", 2)


def test_resume_checkpoint_reports_nothing_on_other_ranks(tmp_path, reporting, monkeypatch):
    monkeypatch.setenv(contract.RANK, "1")
    checkpoint(tmp_path, "checkpoint-3", True)
    assert kt.resume_checkpoint(tmp_path) == str(tmp_path / "checkpoint-3")
    assert read_progress(reporting) is None


@pytest.mark.parametrize(("logs", "fields"), [
    ({"loss": 2.5, "grad_norm": 1.0, "learning_rate": 1e-3, "epoch": 0.1}, {"loss": 2.5, "learning_rate": 1e-3}),
    ({"eval_loss": 2.0, "eval_runtime": 0.1, "epoch": 0.2}, {"eval_loss": 2.0}),
    ({"train_runtime": 3.0, "train_loss": 2.2}, {}),  # the summary at the end is not a step's loss
    ({"loss": "2.5", "learning_rate": True}, {}),  # not numbers
])
def test_progress_fields_maps_the_trainers_logs(logs, fields):
    assert kt.progress_fields(logs) == fields


@pytest.mark.parametrize(("env", "expected"), [
    ({contract.FAIL_AT: "1:13"}, (1, 13)),
    ({contract.FAIL_AT: "1:13", contract.RESTART_GENERATION: "1"}, None),  # the drill fires once
    ({}, None),
])
def test_parse_fail_at(env, expected):
    assert kt.parse_fail_at(env) == expected


def test_parse_fail_at_names_a_bad_value():
    with pytest.raises(ValueError, match="KUBETRAIN_FAIL_AT must be RANK:STEP, got 'x'"):
        kt.parse_fail_at({contract.FAIL_AT: "x"})


def hooks_args(tmp_path: Path) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "ckpt"), use_cpu=True, report_to="none")


def test_the_callback_reports_steps_logs_and_commits_checkpoints(tmp_path, reporting):
    args, state, control = hooks_args(tmp_path), TrainerState(max_steps=10), TrainerControl()
    cb = kt.KubetrainCallback()
    cb.on_train_begin(args, state, control)
    state.global_step = 1
    cb.on_step_end(args, state, control)
    cb.on_log(args, state, control, logs={"loss": 3.0, "learning_rate": 0.01})
    state.global_step = 4
    cb.on_log(args, state, control, logs={"loss": 2.0, "learning_rate": 0.005})
    cb.on_log(args, state, control, logs={"eval_loss": 2.5})
    path = checkpoint(Path(args.output_dir), "checkpoint-4", False)
    cb.on_save(args, state, control)
    assert (path / COMMIT_MARKER).is_file()
    p = read_progress(reporting)
    assert p is not None and p.last_checkpoint is not None
    assert (p.step, p.max_steps, p.loss, p.initial_loss, p.eval_loss, p.learning_rate) == (4, 10, 2.0, 3.0, 2.5, 0.005)
    assert (p.last_checkpoint.step, p.last_checkpoint.path, p.checkpoints) == (4, str(path), [4])
    assert p.resumed_from is None and p.step_seconds is not None


def test_a_resumed_trainer_reports_where_it_resumed(tmp_path, reporting):
    args = hooks_args(tmp_path)
    checkpoint(Path(args.output_dir), "checkpoint-6", True)
    state = TrainerState(max_steps=10, global_step=6, log_history=[{"loss": 4.0, "step": 1}, {"loss": 3.0, "step": 6}])
    kt.KubetrainCallback().on_train_begin(args, state, TrainerControl())
    p = read_progress(reporting)
    assert p is not None
    assert (p.step, p.resumed_from, p.initial_loss, p.checkpoints) == (6, 6, 4.0, [6])


def test_sigterm_saves_at_the_next_step_and_exits_143(tmp_path, reporting):
    args, state, control = hooks_args(tmp_path), TrainerState(max_steps=10), TrainerControl()
    cb, before = kt.KubetrainCallback(), signal.getsignal(signal.SIGTERM)
    cb.on_train_begin(args, state, control)
    signal.raise_signal(signal.SIGTERM)  # only a flag once training has begun
    state.global_step = 3
    cb.on_step_end(args, state, control)
    assert (control.should_save, control.should_training_stop) == (True, True)
    with pytest.raises(SystemExit) as exited:
        cb.on_train_end(args, state, control)
    assert exited.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is before  # the script's own handlers are back
    p = read_progress(reporting)
    assert p is not None and not p.finished


def test_a_signal_in_the_last_step_still_finishes(tmp_path, reporting):
    args, state, control = hooks_args(tmp_path), TrainerState(max_steps=3), TrainerControl()
    cb = kt.KubetrainCallback()
    cb.on_train_begin(args, state, control)
    cb.signalled = True
    state.global_step = 3
    cb.on_step_end(args, state, control)
    cb.on_train_end(args, state, control)  # no SystemExit: training is over
    p = read_progress(reporting)
    assert p is not None and p.finished


def test_the_example_manifest_is_valid(capsys):
    job = Path(__file__).resolve().parents[2] / "examples" / "hf-trainer" / "job.yaml"
    assert main(["validate", str(job)]) == 0
    assert "valid TrainingJob 'hf-trainer'" in capsys.readouterr().out


def test_a_job_whose_checkpoints_go_to_an_object_store_is_refused_naming_the_field(monkeypatch, tmp_path):
    (tmp_path / "termination-log").write_text("")  # the kubelet makes it in a pod
    monkeypatch.setattr(contract, "TERMINATION_LOG", str(tmp_path / "termination-log"))
    with pytest.raises(SystemExit) as stopped:
        kt.refuse_object_store({contract.CHECKPOINT_URI: "s3://bkt/run"})
    assert stopped.value.code == contract.CONFIG_ERROR_EXIT_CODE
    said = (tmp_path / "termination-log").read_text()
    assert said.startswith(f"{contract.CONFIG_ERROR_PREFIX}checkpoint.uri: s3://bkt/run: a Hugging Face Trainer") \
        and "checkpoint.claimName" in said, said
    kt.refuse_object_store({})  # a volume, or a local run: nothing to refuse
