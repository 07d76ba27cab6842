"""spec.lora (trainer/lora.py): peft's adapters on a Hugging Face model built on the meta device; the names that map
the wrapped model back to the checkpoint's; the adapters' seeded initial values, the same whatever the strategy or
layout; only the adapters trained (one gloo process on CPU; 2 processes: tests/e2e/test_lora.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from support.hf_models import tiny_causal_lm
from support.process_group import gloo_world_of_one
from support.trainer_harness import tiny_spec

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer import lora
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.model import (
    HFCausalLM,
    build_model,
    flops_per_token,
    hf_targets,
    init_adapters,
    param_generator,
    transformer_blocks,
)
from kubetrain.trainer.parallel.engines import make_engine

pytest.importorskip("transformers")
pytest.importorskip("peft")

CPU = torch.device("cpu")
LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The tiny Llama's linear layers in each block: peft's all-linear (the head is not one of them)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_causal_lm(tmp_path_factory.mktemp("lora") / "model")


def _spec(path: Path, strategy: str = "fsdp", **extra: Any) -> TrainingJobSpec:
    lora_spec = extra.pop("lora", {"rank": 4, "alpha": 8})
    return TrainingJobSpec.model_validate(tiny_spec(strategy=strategy, model={"hfPath": str(path), "seqLen": 16},
                                                    gradientAccumulationSteps=1, lora=lora_spec, **extra))


def _wrapped(spec: TrainingJobSpec, meta: bool = True) -> HFCausalLM:
    model = build_model(spec.model, False, spec.seed, meta=meta)
    assert isinstance(model, HFCausalLM) and spec.lora is not None
    lora.apply_lora(model, spec.lora)
    return model


def test_names_map_back_to_the_checkpoint_and_tell_the_adapters() -> None:
    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    assert lora.checkpoint_name(f"{layer}.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert lora.checkpoint_name("base_model.model.model.norm.weight") == "model.norm.weight"
    assert lora.checkpoint_name("model.norm.weight") == "model.norm.weight"  # a model without adapters
    for part in ("lora_A", "lora_B"):
        assert lora.is_adapter(f"{layer}.{part}.default.weight")
        assert lora.checkpoint_name(f"{layer}.{part}.default.weight") is None
    assert not lora.is_adapter(f"{layer}.base_layer.weight")


def test_a_wrapped_meta_model_loads_from_the_checkpoints_names_and_trains_only_adapters(model_dir: Path) -> None:
    spec = _spec(model_dir)
    plain = build_model(spec.model, False, spec.seed, meta=True)
    assert isinstance(plain, HFCausalLM)
    model = _wrapped(spec)
    assert all(p.device.type == "meta" for p in model.parameters())  # the adapters too: no storage yet
    assert hf_targets(model).keys() == hf_targets(plain).keys()  # base weights under the checkpoint's names
    names = {n for n, _ in model.inner.named_parameters()}
    adapters = {n for n in names if lora.is_adapter(n)}
    assert {n.split(".")[-4] for n in adapters} == set(LAYERS) and len(adapters) == 2 * 2 * len(LAYERS)
    assert all(p.requires_grad == lora.is_adapter(n) for n, p in model.inner.named_parameters())
    assert "trainable 8,192 of " in lora.trainable_summary(model)  # rank 4 x (in + out) summed over 14 layers
    assert flops_per_token(model, spec.model) < flops_per_token(plain, spec.model)  # frozen: no weight gradients


def test_target_modules_name_the_layers_and_only_linear_ones(model_dir: Path) -> None:
    model = _wrapped(_spec(model_dir, lora={"targetModules": ["q_proj", "v_proj"]}))
    adapted = {n.split(".")[-4] for n, _ in model.inner.named_parameters() if lora.is_adapter(n)}
    assert adapted == {"q_proj", "v_proj"}
    with pytest.raises(ConfigError, match=r"lora\.targetModules"):
        _wrapped(_spec(model_dir, lora={"targetModules": ["no_such_layer"]}))
    with pytest.raises(ConfigError, match="only linear layers"):
        _wrapped(_spec(model_dir, lora={"targetModules": ["embed_tokens"]}))


def test_an_adapters_initial_value_depends_on_the_seed_and_its_name_only() -> None:
    name = "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight"
    shape = torch.Size([4, 64])

    def draw(seed: int, which: str) -> torch.Tensor:
        return lora.adapter_initial_value(which, shape, param_generator(seed, which, CPU), CPU)

    assert torch.equal(draw(1, name), draw(1, name))
    assert not torch.equal(draw(1, name), draw(2, name))
    assert not torch.equal(draw(1, name), draw(1, name.replace("layers.0", "layers.1")))
    assert float(draw(1, name).abs().max()) <= 1 / math.sqrt(64)  # Kaiming-uniform, a = sqrt(5): 1/sqrt(fan_in)
    assert torch.equal(draw(1, name.replace("lora_A", "lora_B")), torch.zeros(shape))


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed  # noqa: PLC0415

    out = {}
    for name, p in model.named_parameters():
        if lora.is_adapter(name):
            with deepspeed.zero.GatheredParameters([p]) if hasattr(p, "ds_id") else torch.no_grad():
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p
                out[name.removeprefix("module.").removeprefix("inner.")] = whole.detach().clone()
    return out


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # a ZeRO-3 partition's whole size


@pytest.mark.parametrize(("strategy", "extra"), [
    ("fsdp", {}),
    ("ddp", {}),
    ("deepspeed", {"deepspeed": {"zeroStage": 3}}),
])
def test_every_strategy_starts_from_the_same_adapters_and_optimizes_only_them(
        model_dir: Path, strategy: str, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")  # the DeepSpeed engine sets it: gone again after the test
    spec = _spec(model_dir, strategy, **extra)
    # The reference: each adapter drawn whole from its own (seed, name) generator, on a model with storage.
    whole = _wrapped(spec, meta=False)
    init_adapters(whole, spec.seed)
    want = _adapters(whole)
    assert want and all(v.abs().max() > 0 for k, v in want.items() if ".lora_A." in k)
    with gloo_world_of_one():
        engine = make_engine(spec, _wrapped(spec), CPU, 1)  # built on meta, sharded (FSDP2), then materialised
        got = _adapters(engine.model)
        optimizer: Any = engine.engine.optimizer if strategy == "deepspeed" else engine.optimizer
        trained = sum(_numel(p) for p in engine.model.parameters() if p.requires_grad)
        assert trained == 8192 and trained < sum(_numel(p) for p in engine.model.parameters())
        if strategy != "deepspeed":  # DeepSpeed's own optimizer holds flat partitions instead
            assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == trained
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_a_rank_of_a_sharded_model_holds_its_rows_of_the_whole_draw(model_dir: Path) -> None:
    """Rank 1 of 2 under FSDP2 (torch's fake process group: no peer needed, nothing sent) keeps exactly its half of
    each adapter's rows as drawn whole: what it holds does not depend on how many ranks share the tensor."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415

    spec = _spec(model_dir)
    model = _wrapped(spec)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=CPU)
        init_adapters(model, spec.seed)
        adapters = [(n, p) for n, p in model.inner.named_parameters() if lora.is_adapter(n)]
        assert len(adapters) == 2 * 2 * len(LAYERS)
        for name, p in adapters:
            whole = lora.adapter_initial_value(name, p.shape, param_generator(spec.seed, name, CPU), CPU)
            assert torch.equal(p.to_local(), torch.chunk(whole, 2, dim=0)[1]), name  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()
