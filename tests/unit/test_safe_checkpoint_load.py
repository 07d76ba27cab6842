"""Checkpoint files load with weights_only: what the trainer saves (RNG states, engine.pt, the PowerSGD
record) loads back equal, and a file whose pickle would run code is refused, naming it, before anything runs."""

from __future__ import annotations

import os
import random
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.process_group import gloo_world_of_one
from support.trainer_harness import tiny_spec

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.checkpoint.directory import TrainerState, load_checkpoint, save_checkpoint
from kubetrain.trainer.checkpoint.safe_load import UntrustedCheckpointError, safe_load
from kubetrain.trainer.model import build_model
from kubetrain.trainer.parallel.compression import PowerSGD
from kubetrain.trainer.parallel.engines import TorchEngine, make_engine

STEPS = 3
POWERSGD = tiny_spec(maxSteps=STEPS, ddp={"gradientCompression": "powersgd", "powerSgdStartStep": 2})
"""Compression starts at step 2, so the saved record holds error feedback and Q factors."""
FP16 = tiny_spec(maxSteps=STEPS, precision="fp16")
"""engine.pt then holds the loss scaler's state besides the scheduler's."""


class RunsCode:
    """Pickles as a call of os.system: loading it without weights_only runs the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


@pytest.fixture(autouse=True)
def process_group() -> Iterator[None]:
    with gloo_world_of_one():
        yield


def new_engine(wire: dict[str, Any]) -> TorchEngine:
    spec = TrainingJobSpec.model_validate(wire)
    engine = make_engine(spec, build_model(spec.model, False, spec.seed), torch.device("cpu"), 1)
    assert isinstance(engine, TorchEngine)
    return engine


def train(engine: TorchEngine) -> None:
    g = torch.Generator().manual_seed(0)
    seq_len = engine.spec.model.seq_len
    for _ in range(STEPS):
        batches = [(torch.randint(0, 256, (2, seq_len), generator=g), torch.randint(0, 256, (2, seq_len), generator=g))]
        engine.forward_backward(batches * 2)
        engine.optimizer_step()


def save(root: Path, engine: TorchEngine) -> Path:
    return save_checkpoint(root, engine, TrainerState(step=STEPS, world_size=1, strategy="ddp"), keep=2)


def compression(engine: TorchEngine) -> PowerSGD:
    assert engine.compression is not None
    return engine.compression


def assert_same_tensors(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> None:
    assert a and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("wire", [POWERSGD, FP16], ids=["powersgd", "fp16"])
def test_what_the_trainer_saves_loads_back_equal(tmp_path: Path, wire: dict[str, Any]) -> None:
    saved = new_engine(wire)
    train(saved)
    random.seed(5)
    rng = (random.getstate(), torch.get_rng_state())
    path = save(tmp_path, saved)
    random.random(), torch.rand(1)  # moved on: the load must bring both back
    extra = {"scheduler": saved.scheduler.state_dict()}
    if saved.scaler is not None:
        extra["scaler"] = saved.scaler.state_dict()
    assert safe_load(path / "engine.pt") == extra

    loaded = new_engine(wire)
    assert load_checkpoint(path, loaded).step == STEPS
    assert random.getstate() == rng[0] and torch.equal(torch.get_rng_state(), rng[1])
    assert loaded.scheduler.state_dict() == saved.scheduler.state_dict()
    assert (loaded.scaler is None) == (saved.scaler is None)
    if saved.scaler is not None and loaded.scaler is not None:
        assert loaded.scaler.state_dict() == saved.scaler.state_dict()


def test_the_powersgd_record_loads_back_equal(tmp_path: Path) -> None:
    saved = new_engine(POWERSGD)
    train(saved)
    path = save(tmp_path, saved)
    loaded = new_engine(POWERSGD)
    load_checkpoint(path, loaded)
    before, after = compression(saved), compression(loaded)
    assert after.state.iter == before.state.iter == STEPS
    held = before.snapshot()
    assert_same_tensors(after.pending.errors, held.errors)
    assert_same_tensors(after.pending.qs, held.qs)
    assert torch.equal(torch.from_numpy(after.state.rng.randn(8)), torch.from_numpy(before.state.rng.randn(8)))


@pytest.mark.parametrize("name", ["rng/rank-00000.pt", "engine.pt", "powersgd/rank-00000.pt"])
def test_a_file_that_would_run_code_is_refused(tmp_path: Path, name: str) -> None:
    engine = new_engine(POWERSGD)
    train(engine)
    path = save(tmp_path / "checkpoints", engine)
    pwned = tmp_path / "pwned"
    torch.save({"scheduler": RunsCode(f"touch {shlex.quote(str(pwned))}")}, path / name)

    try:
        with pytest.raises(UntrustedCheckpointError) as refused:
            load_checkpoint(path, new_engine(POWERSGD))
    finally:  # checked first, whatever the load raised: the code must never have run
        assert not pwned.exists(), "loading the checkpoint ran the code in its pickle"
    message = str(refused.value)
    assert refused.value.path == path / name
    assert f"refused to load {path / name}: it holds objects the trainer never saves" in message
    assert "(it needs posix.system)" in message and "may have been tampered with" in message
