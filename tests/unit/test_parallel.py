"""The trainer's parallel layout: the (pp, dp, tp) grid, the data each rank reads, the head split that tensor
parallelism relies on, the pipeline stages' split of the blocks, and (in a one-process gloo group) loading
checkpoints of the fused attention tensor parallelism replaced. The multi-process runs are
tests/e2e/test_tensor_parallel.py and tests/e2e/test_pipeline_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.hf_models import tiny_causal_lm
from support.process_group import gloo_world_of_one
from support.trainer_harness import tiny_spec
from torch import nn

from kubetrain.core.api import FSDPSpec, TrainingJobSpec
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.data.text import Sampler
from kubetrain.trainer.model import Attention, build_model
from kubetrain.trainer.parallel import Layout
from kubetrain.trainer.parallel.engines import fsdp_sync, make_engine
from kubetrain.trainer.parallel.pipeline import RankPart, rank_stages, split_stage, split_stages, stage_blocks
from kubetrain.trainer.parallel.tensor import hf_plan


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


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _fused(tensors: dict) -> dict:
    """q, k and v's entries of a state dict as the earlier layout had them: one `attn.qkv` of their rows."""
    out = {}
    for key, value in tensors.items():
        if ".attn.q." in key:
            parts = [tensors[key.replace(".attn.q.", f".attn.{n}.")] for n in "qkv"]
            if isinstance(value, dict):  # an optimizer's per-parameter state
                out[key.replace(".attn.q.", ".attn.qkv.")] = {
                    k: torch.cat([_whole(p[k]) for p in parts]) if v.dim() else v.clone() for k, v in value.items()}
            else:
                out[key.replace(".attn.q.", ".attn.qkv.")] = torch.cat([_whole(p) for p in parts])
        elif ".attn.k." not in key and ".attn.v." not in key:
            out[key] = value
    return out


def test_a_checkpoint_of_the_fused_attention_loads_into_q_k_and_v(tmp_path: Path) -> None:
    """Checkpoints of the built-in model written before q, k and v were split (one `attn.qkv`, rows [q; k; v],
    for the model and the optimizer's moments) resume into the split layout: the same weights and moments."""
    spec = TrainingJobSpec.model_validate(tiny_spec(strategy="fsdp"))
    batch = [(torch.randint(0, 256, (2, spec.model.seq_len)), torch.randint(0, 256, (2, spec.model.seq_len)))]
    with gloo_world_of_one():
        trained = make_engine(spec, build_model(spec.model, False, spec.seed), torch.device("cpu"), 1)
        for _ in range(2):
            trained.forward_backward(batch)
            trained.optimizer_step()
        state = trained._state()
        groups = [{**g, "params": [p.replace(".attn.q.", ".attn.qkv.") for p in g["params"]
                                   if ".attn.k." not in p and ".attn.v." not in p]} for g in state["optim"]["param_groups"]]
        old = {"model": _fused(state["model"]),
               "optim": {"state": _fused(state["optim"]["state"]), "param_groups": groups}}
        dcp.save(old, checkpoint_id=str(tmp_path / "dcp"))
        trained._save_small(tmp_path)
        fresh = make_engine(spec, build_model(spec.model, False, spec.seed + 1), torch.device("cpu"), 1)
        fresh.load(tmp_path, 1)
        want, got = trained._state(), fresh._state()
    for key, value in want["model"].items():
        torch.testing.assert_close(got["model"][key].full_tensor(), value.full_tensor(), rtol=0, atol=0)
    q = next(k for k in want["optim"]["state"] if ".attn.k.weight" in k)
    for moment in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(got["optim"]["state"][q][moment].full_tensor(),
                                   want["optim"]["state"][q][moment].full_tensor(), rtol=0, atol=0)
    assert float(got["optim"]["state"][q]["step"]) == 2.0


def test_a_deepspeed_checkpoint_of_the_fused_attention_is_refused_naming_the_image(tmp_path: Path) -> None:
    """ZeRO's flat optimizer partitions follow the parameters' order, which the split changed: no safe
    conversion, so a permanent configuration error (exit 2) instead of a load error retried for ever."""
    spec = TrainingJobSpec.model_validate(tiny_spec(strategy="deepspeed", precision="fp32"))
    with gloo_world_of_one():
        engine = make_engine(spec, build_model(spec.model, False, spec.seed), torch.device("cpu"), 1)
        engine.save(tmp_path)
        states = next(tmp_path.rglob("mp_rank_00_model_states.pt"))
        saved = torch.load(states, weights_only=False)
        saved["module"] = _fused(saved["module"])
        torch.save(saved, states)
        with pytest.raises(ConfigError) as refused:
            engine.load(tmp_path, 1)
    assert refused.value.field == "image" and "fused attn.qkv" in refused.value.message


# --------------------------------------------------------------------------- pipeline parallelism


@pytest.mark.parametrize(("world", "tensor", "pipeline", "shape", "names"), [
    (2, 1, 2, (2, 1), ("pp", "dp")),
    (4, 1, 2, (2, 2), ("pp", "dp")),
    (8, 2, 2, (2, 2, 2), ("pp", "dp", "tp")),
    (4, 1, 4, (4, 1), ("pp", "dp")),
])
def test_the_mesh_is_stages_by_data_replicas_by_tensor_degree(world: int, tensor: int, pipeline: int,
                                                              shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    layout = Layout(world, tensor, pipeline)
    assert (layout.shape, layout.names, layout.data) == (shape, names, world // tensor // pipeline)


def test_stages_are_the_outer_dimension_and_their_ranks_read_the_same_batches() -> None:
    """rank = (pp_rank x D + dp_rank) x T + tp_rank: stage s's ranks are one contiguous run, each stage has
    every data replica once, and the replica (the data a rank reads) is the same down a pipeline."""
    layout = Layout(8, 1, 2)
    assert [layout.pipeline_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.data_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    grid = Layout(8, 2, 2)
    assert [(grid.pipeline_rank(r), grid.data_rank(r), grid.tensor_rank(r)) for r in range(8)] == [
        (p, d, t) for p in range(2) for d in range(2) for t in range(2)]


def test_a_pipeline_that_does_not_divide_the_world_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as refused:
        Layout(6, 2, 2)
    assert refused.value.field == "parallelism.pipeline"


# --------------------------------------------------------------------------- HSDP (parallelism.replicate)


@pytest.mark.parametrize(("world", "tensor", "pipeline", "replicate", "shape", "names"), [
    (4, 1, 1, 2, (2, 2), ("replicate", "dp")),
    (16, 1, 1, 2, (2, 8), ("replicate", "dp")),  # 2 nodes of 8: shard within a node, replicate across
    (16, 2, 1, 2, (2, 4, 2), ("replicate", "dp", "tp")),
    (16, 2, 2, 2, (2, 2, 2, 2), ("pp", "replicate", "dp", "tp")),
    (4, 1, 1, 4, (4, 1), ("replicate", "dp")),  # every rank its own group: DDP-like
])
def test_hsdp_splits_the_data_dimension_into_replica_groups(world: int, tensor: int, pipeline: int, replicate: int,
                                                            shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    layout = Layout(world, tensor, pipeline, replicate)
    assert (layout.shape, layout.names) == (shape, names)
    assert layout.data == world // tensor // pipeline and layout.shard * replicate == layout.data
    plain = Layout(world, tensor, pipeline)  # which data a rank reads does not depend on the grouping
    assert [layout.data_rank(r) for r in range(world)] == [plain.data_rank(r) for r in range(world)]


def test_an_hsdp_group_is_consecutive_ranks_so_one_worker_holds_it() -> None:
    """2 workers x 4 processes, replicate 2: the shard group of ranks 0-3 is worker 0, of 4-7 worker 1."""
    layout = Layout(8, 1, 1, 2)
    groups = [[r for r in range(8) if layout.data_rank(r) // layout.shard == g] for g in range(2)]
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_replicate_degree_that_does_not_divide_the_data_ranks_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as refused:
        Layout(8, 2, 1, 3)
    assert refused.value.field == "parallelism.replicate" and "data-parallel ranks 4" in refused.value.message


@pytest.mark.parametrize(("fsdp", "replicas", "switches"), [
    (None, 1, [{}, {}, {}]),  # every micro-batch reduce-scatters: gradients stay sharded
    (FSDPSpec(), 1, [{}, {}, {}]),
    (None, 2, [{"set_requires_all_reduce": False}] * 2 + [{"set_requires_all_reduce": True}]),  # HSDP: once a step
    (FSDPSpec(accumulateUnsharded=True), 1,
     [{"set_requires_gradient_sync": False}] * 2 + [{"set_requires_gradient_sync": True}]),
    (FSDPSpec(accumulateUnsharded=True), 2,
     [{"set_requires_gradient_sync": False}] * 2 + [{"set_requires_gradient_sync": True}]),
])
def test_fsdp_gradients_accumulate_sharded_unless_asked_otherwise(fsdp: FSDPSpec | None, replicas: int,
                                                                 switches: list[dict[str, bool]]) -> None:
    """Three micro-batches: which FSDP2 switches each backward sets."""
    assert [fsdp_sync(fsdp, replicas, last) for last in (False, False, True)] == switches


@pytest.mark.parametrize(("layers", "stages", "runs"), [
    (2, 2, [[0], [1]]),
    (4, 2, [[0, 1], [2, 3]]),
    (5, 2, [[0, 1, 2], [3, 4]]),
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
    (3, 3, [[0], [1], [2]]),
])
def test_stages_take_consecutive_runs_of_blocks_covering_the_model(layers: int, stages: int,
                                                                   runs: list[list[int]]) -> None:
    assert [list(stage_blocks(layers, stages, s)) for s in range(stages)] == runs


def test_more_stages_than_blocks_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as refused:
        stage_blocks(2, 3, 0)
    assert refused.value.field == "parallelism.pipeline"


def test_stages_keep_the_whole_models_parameter_names_and_together_hold_all_of_it() -> None:
    """Deleted, not renamed: a checkpoint written by any layout names the same tensors."""
    spec = TrainingJobSpec.model_validate(tiny_spec(model={"dModel": 16, "nLayers": 3, "nHeads": 2, "seqLen": 8}))
    whole = build_model(spec.model, False, spec.seed)
    names = {n: p for n, p in whole.named_parameters()}
    stages = [split_stage(build_model(spec.model, False, spec.seed), s, 2) for s in range(2)]
    parts = [dict(stage.named_parameters()) for stage in stages]
    assert not set(parts[0]) & set(parts[1]) and set(parts[0]) | set(parts[1]) == set(names)
    assert {"tok.weight", "pos.weight", "blocks.0.attn.q.weight", "blocks.1.mlp.out.bias"} <= set(parts[0])
    assert {"blocks.2.ln1.weight", "ln_f.weight", "head.weight"} <= set(parts[1])
    for part in parts:
        assert all(torch.equal(p, names[n]) for n, p in part.items())


def test_the_stages_in_turn_compute_the_whole_models_loss() -> None:
    spec = TrainingJobSpec.model_validate(tiny_spec(model={"dModel": 16, "nLayers": 3, "nHeads": 2, "seqLen": 8}))
    whole = build_model(spec.model, False, spec.seed)
    first, last = (split_stage(build_model(spec.model, False, spec.seed), s, 2) for s in range(2))
    x = torch.randint(0, 256, (2, 8))
    y = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        assert torch.equal(last(first(x), y), whole(x, y))


@pytest.mark.parametrize(("pp_rank", "pipeline", "schedule", "stages"), [
    (0, 2, "1F1B", [0]), (1, 2, "GPipe", [1]),
    (0, 2, "Interleaved1F1B", [0, 2]), (1, 2, "Interleaved1F1B", [1, 3]), (2, 4, "Interleaved1F1B", [2, 6]),
])
def test_interleaved_ranks_run_every_pth_stage(pp_rank: int, pipeline: int, schedule: str, stages: list[int]) -> None:
    assert rank_stages(pp_rank, pipeline, schedule) == stages


def test_a_ranks_interleaved_stages_are_one_module_under_the_whole_models_names() -> None:
    """What the optimizer and the checkpoints see of rank 0's stages 0 and 2 of 4 (4 blocks)."""
    spec = TrainingJobSpec.model_validate(tiny_spec(model={"dModel": 16, "nLayers": 4, "nHeads": 2, "seqLen": 8}))
    whole = dict(build_model(spec.model, False, spec.seed).named_parameters())
    part = RankPart(split_stages(build_model(spec.model, False, spec.seed), [0, 2], 4))
    names = dict(part.named_parameters())
    assert {n.split(".")[0] + "." + n.split(".")[1] for n in names if n.startswith("blocks.")} == {"blocks.0", "blocks.2"}
    assert "tok.weight" in names and "head.weight" not in names
    assert all(torch.equal(p, whole[n]) for n, p in names.items())


def _hf_config(model_type: str, **settings: int) -> object:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, **settings)
    config.name_or_path = "/models/tiny"
    return config


@pytest.mark.parametrize(("model_type", "heads", "kv_heads", "tensor", "reason"), [
    ("llama", 4, 2, 4, "4 must divide both num_attention_heads 4 and num_key_value_heads 2"),
    ("mistral", 6, 6, 4, "4 must divide both num_attention_heads 6 and num_key_value_heads 6"),
    ("qwen3", 4, 2, 4, "4 must divide both num_attention_heads 4 and num_key_value_heads 2"),
    ("gpt2", 4, 4, 2, "model.hfPath /models/tiny is a 'gpt2' model; tensor parallelism supports the built-in model "
                      "and the Hugging Face model types llama, mistral, qwen2, qwen3: use parallelism.tensor 1"),
])
def test_hf_models_tensor_parallelism_cannot_split_are_refused(model_type: str, heads: int, kv_heads: int,
                                                               tensor: int, reason: str) -> None:
    settings = {"n_head": heads} if model_type == "gpt2" else {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    with pytest.raises(ConfigError) as refused:
        hf_plan(_hf_config(model_type, **settings), tensor)
    assert refused.value.field == "parallelism.tensor" and reason in refused.value.message


LLAMA_STYLES = {"self_attn.q_proj": "ColwiseParallel", "self_attn.k_proj": "ColwiseParallel",
                "self_attn.v_proj": "ColwiseParallel", "self_attn.o_proj": "RowwiseParallel",
                "mlp.gate_proj": "ColwiseParallel", "mlp.up_proj": "ColwiseParallel", "mlp.down_proj": "RowwiseParallel"}


@pytest.mark.parametrize(("model_type", "extra"), [
    ("llama", {}), ("mistral", {}), ("qwen2", {}),
    # Qwen3's per-head norms: replicated weights over the shards of the heads dimension
    ("qwen3", {"self_attn.q_norm": "SequenceParallel", "self_attn.k_norm": "SequenceParallel"}),
])
def test_llama_family_models_split_their_projections(model_type: str, extra: dict[str, str]) -> None:
    plan = hf_plan(_hf_config(model_type, num_attention_heads=4, num_key_value_heads=2), 2)
    assert {name: type(style).__name__ for name, style in plan.items()} == {**LLAMA_STYLES, **extra}


def test_a_loaded_hf_model_is_refused_naming_its_path(tmp_path: Path) -> None:
    """The trainer's own loader: the refusal names model.hfPath, and the key/value heads T must divide."""
    model_dir = tiny_causal_lm(tmp_path / "llama", num_key_value_heads=1)
    spec = TrainingJobSpec.model_validate(tiny_spec(strategy="fsdp", model={"hfPath": str(model_dir)}))
    model = build_model(spec.model, False, spec.seed)
    with pytest.raises(ConfigError) as refused:
        hf_plan(model.inner.config, 2)  # type: ignore[union-attr]
    assert refused.value.message.startswith("2 must divide both num_attention_heads 4 and num_key_value_heads 1")
    model.inner.config.model_type = "gpt2"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=f"model.hfPath {model_dir} is a 'gpt2' model"):
        hf_plan(model.inner.config, 2)  # type: ignore[union-attr]
