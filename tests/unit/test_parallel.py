"""The trainer's parallel layout: the (dp, tp) grid, the data each rank reads, the head split that tensor
parallelism relies on, and (in a one-process gloo group) the refusal of checkpoints of the fused attention
it replaced. The multi-process runs are tests/e2e/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.process_group import gloo_world_of_one
from support.trainer_harness import tiny_spec
from torch import nn

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.data import Sampler
from kubetrain.trainer.engines import make_engine
from kubetrain.trainer.model import Attention, build_model
from kubetrain.trainer.parallel import Layout


@pytest.mark.parametrize(("world", "tensor", "shape", "names"), [
    (1, 1, (1,), ("dp",)),
    (8, 1, (8,), ("dp",)),
    (2, 2, (1, 2), ("dp", "tp")),
    (8, 2, (4, 2), ("dp", "tp")),
    (8, 8, (1, 8), ("dp", "tp")),
])
def test_the_mesh_is_data_replicas_by_tensor_degree(world: int, tensor: int, shape: tuple[int, ...],
                                                    names: tuple[str, ...]) -> None:
    layout = Layout(world, tensor)
    assert (layout.shape, layout.names, layout.data) == (shape, names, world // tensor)


def test_a_tensor_degree_that_does_not_divide_the_world_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as refused:
        Layout(6, 4)
    assert refused.value.field == "parallelism.tensor"


@pytest.mark.parametrize(("workers", "procs", "tensor"), [(1, 2, 2), (2, 2, 2), (2, 4, 2), (3, 4, 4), (2, 8, 4)])
def test_every_tensor_parallel_group_is_inside_one_worker(workers: int, procs: int, tensor: int) -> None:
    """Ranks are NODE_RANK x procsPerWorker + LOCAL_RANK: consecutive ranks share a worker, and so does a group."""
    layout = Layout(workers * procs, tensor)
    groups: dict[int, list[int]] = {}
    for rank in range(workers * procs):
        groups.setdefault(layout.data_rank(rank), []).append(rank)
    assert len(groups) == layout.data
    for members in groups.values():
        assert [layout.tensor_rank(r) for r in members] == list(range(tensor))
        assert len({r // procs for r in members}) == 1  # one worker


def test_tensor_parallel_peers_read_the_same_batch_and_replicas_split_the_global_one() -> None:
    corpus = torch.arange(4000, dtype=torch.int64).remainder(256).to(torch.uint8)
    sampler, layout, step = Sampler(corpus, 16, seed=3), Layout(4, 2), 7
    per_rank = [sampler.micro_batches(step, 2, 2, layout.data, layout.data_rank(r)) for r in range(4)]
    for a, b in ((0, 1), (2, 3)):
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(per_rank[a], per_rank[b], strict=True))
    # replica 0's micro-batches, then replica 1's: what one process accumulates over 4 micro-batches
    whole = sampler.micro_batches(step, 2, 4, 1, 0)
    assert torch.equal(torch.cat([x for r in (0, 2) for x, _ in per_rank[r]]), torch.cat([x for x, _ in whole]))


def _slice_of(full: nn.Linear, rows: slice | None = None, cols: slice | None = None) -> nn.Linear:
    part = nn.Linear(1, 1)
    part.weight = nn.Parameter(full.weight.detach()[rows or slice(None), cols or slice(None)].clone())
    part.bias = nn.Parameter(full.bias.detach()[rows].clone() if rows else torch.zeros_like(full.bias))
    return part


def test_attention_split_by_heads_sums_to_the_whole() -> None:
    """What column-parallel q/k/v and a row-parallel output projection compute: each half of the heads
    alone, then the sum of the halves' projections (the all-reduce) plus the bias once."""
    torch.manual_seed(0)
    full, x = Attention(16, 4), torch.randn(2, 5, 16)
    total = full.proj.bias.detach().clone()
    for half in (slice(0, 8), slice(8, 16)):
        part = Attention(16, 4)
        part.q, part.k, part.v = (_slice_of(getattr(full, n), rows=half) for n in ("q", "k", "v"))
        part.proj = _slice_of(full.proj, cols=half)
        total = total + part(x)
    torch.testing.assert_close(total, full(x), rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_the_fused_attention_is_refused_naming_the_image(tmp_path: Path) -> None:
    """Checkpoints of the built-in model written before q, k and v were split (one `attn.qkv`) cannot load:
    a configuration error (permanent, exit 2) instead of a load error that restarts the gang for ever."""
    spec = TrainingJobSpec.model_validate(tiny_spec(strategy="fsdp"))
    with gloo_world_of_one():
        engine = make_engine(spec, build_model(spec.model, False, spec.seed), torch.device("cpu"), 1)
        state = engine._state()
        state["model"] = {k.replace(".attn.q.", ".attn.qkv."): v for k, v in state["model"].items()}
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
        with pytest.raises(ConfigError) as refused:
            engine.load(tmp_path, 1)
    assert refused.value.field == "image" and "fused qkv" in refused.value.message
