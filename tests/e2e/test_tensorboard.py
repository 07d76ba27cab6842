"""The trainer's TensorBoard event files, read back with TensorBoard's own reader."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from support.trainer_harness import Gang, tiny_spec

from kubetrain.core import contract
from kubetrain.trainer.observe import tensorboard as tb

pytestmark = pytest.mark.e2e
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def scalars(directory: Path) -> dict[str, dict[int, float]]:
    acc = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_crc32c_matches_the_published_check_value() -> None:
    assert tb.crc32c(b"123456789") == 0xE3069283  # RFC 3720's CRC-32C check value
    assert struct.unpack("<Q", tb.record(b"abc")[:8]) == (3,)


def test_a_run_writes_the_scalars_tensorboard_reads(tmp_path: Path) -> None:
    spec = tiny_spec(strategy="ddp", maxSteps=6, evalEverySteps=3, evalBatches=1)
    run = Gang(tmp_path / "run", spec).wait()
    assert run.exit_codes == [0, 0], run.log()
    got = scalars(run.ckpt_dir / contract.TENSORBOARD_DIR)
    assert sorted(got["train/loss"]) == list(range(1, 7))
    for step, loss in run.losses.items():
        assert got["train/loss"][step] == pytest.approx(loss, rel=1e-6)  # float32 in the event file
    assert sorted(got["eval/loss"]) == [3, 6] and set(got) >= {"train/lr", "train/grad_norm", "train/tokens_per_second"}
    assert "train/mfu" not in got  # CPU: no known peak, nothing made up


def test_kubetrain_tensorboard_finds_a_local_runs_event_files(tmp_path: Path) -> None:
    from kubetrain.core.cli import board_dir  # noqa: PLC0415

    run = Gang(tmp_path / "run", tiny_spec(maxSteps=2)).wait()
    assert run.exit_codes == [0, 0], run.log()
    assert board_dir(str(tmp_path / "run")) == run.ckpt_dir / contract.TENSORBOARD_DIR
    assert board_dir(str(tmp_path / "nothing-here")) is None
