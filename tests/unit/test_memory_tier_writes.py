"""A memory-tier save leaves the step (checkpoint/memory.py): inside it the rank only copies its state into a
snapshot it reuses; a thread writes the files while training goes on, and the step they hold is the saved one,
complete only once COMMITTED is written (a torn one is never offered). One process, a real tiny engine."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.process_group import gloo_world_of_one
from support.trainer_harness import tiny_spec
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from kubetrain.core.api import TrainingJobSpec
from kubetrain.core.progress import COMMIT_MARKER
from kubetrain.trainer.checkpoint import memory
from kubetrain.trainer.checkpoint.directory import TrainerState
from kubetrain.trainer.checkpoint.memory import STATE_FILE, MemoryTier, Snapshot, TierSettings
from kubetrain.trainer.checkpoint.safe_load import safe_load
from kubetrain.trainer.model import build_model
from kubetrain.trainer.parallel.engines import make_engine


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[MemoryTier]:
    with gloo_world_of_one():
        spec = TrainingJobSpec.model_validate(tiny_spec())
        engine = make_engine(spec, build_model(spec.model, False, spec.seed), torch.device("cpu"), 1)
        local = engine.local_state()
        assert local is not None
        t = MemoryTier(TierSettings(tmp_path, 5, None), local, rank=0, world_size=1, strategy="ddp")
        yield t
        t.close()


def _first(t: MemoryTier) -> tuple[str, torch.Tensor]:
    """The first tensor of the model's state dict, by its checkpoint name (the live parameter itself)."""
    return next(iter(get_model_state_dict(t.engine.model).items()))


def test_the_write_holds_the_saved_steps_state_while_training_changes_it(tier, monkeypatch) -> None:
    release = threading.Event()
    real_save = torch.save

    def slow_save(obj: Any, path: Any) -> None:
        assert release.wait(30)
        real_save(obj, path)

    monkeypatch.setattr(memory.torch, "save", slow_save)
    name, live = _first(tier)
    before = live.detach().clone()
    path = tier.maybe_save(TrainerState(step=5, world_size=1), final=False)
    assert path is not None and tier.pending is not None  # the step goes on: the write has not even begun
    assert not (path / COMMIT_MARKER).exists() and tier.held() == []  # torn until committed: never offered
    with torch.no_grad():
        live.add_(1.0)  # the next optimizer step
    release.set()
    tier.collect(wait=True)
    assert [s for s, _ in tier.held()] == [5]
    saved = safe_load(path / STATE_FILE)["engine"]["model"]
    assert torch.equal(saved[name], before) and not torch.equal(saved[name], live)


def test_one_write_in_flight_and_only_the_newest_step_kept(tier) -> None:
    for step in (5, 10, 15):
        tier.maybe_save(TrainerState(step=step, world_size=1), final=False)  # each waits for the one before
    tier.collect(wait=True)
    assert [s for s, _ in tier.held()] == [15] and tier.last_bytes is not None


def test_a_state_bigger_than_its_budget_turns_the_tier_off(tier) -> None:
    tier.budget_bytes = 1024
    tier.maybe_save(TrainerState(step=5, world_size=1), final=False)
    tier.collect(wait=True)
    assert not tier.active and not tier.root.exists()


def test_the_snapshot_reuses_its_buffers() -> None:
    snap = Snapshot(pinned=False)
    w = torch.ones(3)
    first = snap.take({"w": w, "tied": w, "lr": [0.1]})
    assert first["tied"] is first["w"] and len(snap.buffers) == 1  # a tensor met twice is copied once
    w.add_(1)
    second = snap.take({"w": w, "tied": w, "lr": [0.1]})
    assert second["w"].data_ptr() == first["w"].data_ptr() and torch.equal(second["w"], torch.full((3,), 2.0))
    assert snap.nbytes() == 12
