"""Models built on the meta device and given storage only once sharded (parallel/materialize.py): the weights
depend on the seed and the parameter's name alone, so every strategy starts where a whole model built on one
process does (one gloo process on CPU; the multi-process layouts are the e2e equivalence tests')."""

from __future__ import annotations

import pytest
import torch
from support.process_group import gloo_world_of_one
from support.trainer_harness import tiny_spec

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer import parallel
from kubetrain.trainer.model import Transformer, build_model, init_weights, initial_value, param_generator
from kubetrain.trainer.parallel.engines import make_engine


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name.removeprefix("module."): _whole(p.detach()).clone() for name, p in model.named_parameters()}


def test_a_parameters_initial_value_depends_on_the_seed_and_its_name_only() -> None:
    spec = TrainingJobSpec.model_validate(tiny_spec())
    cpu = torch.device("cpu")
    shape = torch.Size([8, 4])

    def draw(seed: int, name: str) -> torch.Tensor:
        return initial_value(name, shape, spec.model.n_layers, param_generator(seed, name, cpu), cpu)

    assert torch.equal(draw(1, "blocks.0.mlp.fc.weight"), draw(1, "blocks.0.mlp.fc.weight"))
    assert not torch.equal(draw(1, "blocks.0.mlp.fc.weight"), draw(2, "blocks.0.mlp.fc.weight"))
    assert not torch.equal(draw(1, "blocks.0.mlp.fc.weight"), draw(1, "blocks.1.mlp.fc.weight"))
    scaled = draw(1, "blocks.0.attn.proj.weight").std() / draw(1, "blocks.0.attn.q.weight").std()
    assert float(scaled) == pytest.approx((2 * spec.model.n_layers) ** -0.5, rel=0.5)  # GPT-2's scaled residuals
    assert torch.equal(initial_value("ln_f.bias", torch.Size([4]), 2, param_generator(1, "x", cpu), cpu),
                       torch.zeros(4))
    assert torch.equal(initial_value("ln_f.weight", torch.Size([4]), 2, param_generator(1, "x", cpu), cpu),
                       torch.ones(4))


def test_a_model_built_on_meta_holds_no_storage_until_materialised() -> None:
    spec = TrainingJobSpec.model_validate(tiny_spec(strategy="fsdp"))
    model = build_model(spec.model, False, spec.seed, meta=True)
    assert parallel.on_meta(model) and all(p.device.type == "meta" for p in model.parameters())
    whole = build_model(spec.model, False, spec.seed)
    parallel.materialize(model, spec, torch.device("cpu"))
    assert not parallel.on_meta(model)
    assert _values(model).keys() == _values(whole).keys()
    for name, value in _values(whole).items():
        assert torch.equal(_values(model)[name], value), name


def test_a_transformer_built_under_the_meta_device_is_left_without_storage() -> None:
    spec = TrainingJobSpec.model_validate(tiny_spec())
    with torch.device("meta"):
        model = Transformer(spec.model)  # the default seed: nothing to draw on meta
    assert parallel.on_meta(model) and model.num_params(exclude_embeddings=False) > 0


def test_the_initial_weights_do_not_depend_on_the_draws_before_them() -> None:
    """The global RNG (what other code draws from) plays no part: each parameter has its own generator."""
    spec = TrainingJobSpec.model_validate(tiny_spec())
    first = Transformer(spec.model, seed=5)
    torch.rand(1000)
    second = Transformer(spec.model, seed=5)
    init_weights(second, spec.model, 5)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(("strategy", "extra"), [
    ("fsdp", {}),
    ("fsdp", {"fsdp": {"cpuOffload": True}}),
    ("ddp", {}),
    ("deepspeed", {"deepspeed": {"zeroStage": 2}, "precision": "fp32"}),
    ("deepspeed", {"deepspeed": {"zeroStage": 3}, "precision": "fp32"}),
])
def test_every_strategy_starts_from_the_whole_models_weights_when_built_on_meta(
        strategy: str, extra: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed's engine sets it in the process: gone after the test
    spec = TrainingJobSpec.model_validate(tiny_spec(strategy=strategy, **extra))
    reference = _values(build_model(spec.model, False, spec.seed))
    with gloo_world_of_one():
        engine = make_engine(spec, build_model(spec.model, False, spec.seed, meta=True), torch.device("cpu"), 1)
        if strategy == "deepspeed" and extra["deepspeed"] == {"zeroStage": 3}:
            import deepspeed  # noqa: PLC0415 - ZeRO-3 keeps partitions: gather to compare

            with deepspeed.zero.GatheredParameters(list(engine.model.parameters())):
                got = _values(engine.model)
        else:
            got = _values(engine.model)
    assert got.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_zero3_built_on_meta_holds_the_parameters_a_whole_models_engine_holds(
        precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """deepspeed.initialize casts no model built under zero.Init: the build itself must give the job's dtype, or a
    bf16 job trains in fp32 (8.6x slower on an H200)."""
    import deepspeed  # noqa: PLC0415

    monkeypatch.setenv("LOCAL_RANK", "0")
    spec = TrainingJobSpec.model_validate(tiny_spec(strategy="deepspeed", deepspeed={"zeroStage": 3},
                                                    precision=precision))
    held = {}
    with gloo_world_of_one():
        for meta in (False, True):
            engine = make_engine(spec, build_model(spec.model, False, spec.seed, meta=meta), torch.device("cpu"), 1)
            with deepspeed.zero.GatheredParameters(list(engine.model.parameters())):
                held[meta] = _values(engine.model)
    assert {v.dtype for v in held[True].values()} == {torch.bfloat16 if precision == "bf16" else torch.float32}
    for name, value in held[False].items():
        assert torch.equal(held[True][name], value), name
