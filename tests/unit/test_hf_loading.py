"""Hugging Face models (model.hfPath) built on the meta device and loaded only once sharded (model.empty_hf_model,
model.load_hf_weights): every strategy starts from exactly ``from_pretrained``'s weights and logits, whatever the
checkpoint's dtype and files (one gloo process on CPU; two processes: tests/e2e/test_hf_sharded_load.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from support.hf_models import tiny_causal_lm
from support.process_group import gloo_world_of_one
from support.trainer_harness import tiny_spec

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer import parallel
from kubetrain.trainer.model import HFCausalLM, build_model
from kubetrain.trainer.parallel.engines import make_engine

transformers = pytest.importorskip("transformers")

CHECKPOINTS = {
    "fp32": {},
    "bf16_tied": {"dtype": "bfloat16", "tie_word_embeddings": True},
    "sharded": {"max_shard_size": "40KB"},
}
"""How the tiny Llama is saved: one fp32 file; bf16 with the output head tied to the embeddings (one parameter);
several files with model.safetensors.index.json."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_loading")
    dirs = {name: tiny_causal_lm(root / name, **kw) for name, kw in CHECKPOINTS.items()}
    assert (dirs["sharded"] / "model.safetensors.index.json").is_file()
    return dirs


def _spec(path: Path, strategy: str = "fsdp", **extra: Any) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(tiny_spec(strategy=strategy, model={"hfPath": str(path), "seqLen": 16},
                                                    gradientAccumulationSteps=1, **extra))


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def _assert_same(got: dict[str, torch.Tensor], reference: torch.nn.Module) -> None:
    want = _values(reference)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def test_a_meta_built_hf_model_holds_no_storage_and_keeps_its_ties(checkpoints: dict[str, Path]) -> None:
    spec = _spec(checkpoints["bf16_tied"])
    model = build_model(spec.model, False, spec.seed, meta=True)
    assert isinstance(model, HFCausalLM) and parallel.on_meta(model)
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    inner: Any = model.inner
    assert inner.lm_head.weight is inner.model.embed_tokens.weight
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_fsdp_loads_exactly_from_pretrained_weights_and_logits(checkpoints: dict[str, Path], checkpoint: str) -> None:
    spec = _spec(checkpoints[checkpoint])
    reference = build_model(spec.model, False, spec.seed)  # from_pretrained, whole, fp32
    with gloo_world_of_one():
        engine = make_engine(spec, build_model(spec.model, False, spec.seed, meta=True), torch.device("cpu"), 1)
        _assert_same(_values(engine.model), reference)
        inner: Any = engine.model.inner
        if checkpoint == "bf16_tied":
            assert inner.lm_head.weight is inner.model.embed_tokens.weight
        with torch.no_grad():
            assert torch.equal(engine.model(TOKENS, TOKENS), reference(TOKENS, TOKENS))
            engine.model.unshard()  # type: ignore[operator] - the root's parameters (FSDP2), for a call inside it
            assert torch.equal(inner(input_ids=TOKENS).logits, reference.inner(input_ids=TOKENS).logits)  # type: ignore[operator]


def test_ddp_loads_the_whole_model_on_each_rank(checkpoints: dict[str, Path]) -> None:
    spec = _spec(checkpoints["bf16_tied"], strategy="ddp")
    reference = build_model(spec.model, False, spec.seed)
    with gloo_world_of_one():
        engine = make_engine(spec, build_model(spec.model, False, spec.seed, meta=True), torch.device("cpu"), 1)
        _assert_same(_values(engine.model), reference)
        with torch.no_grad():
            assert torch.equal(engine.model(TOKENS, TOKENS), reference(TOKENS, TOKENS))


def _losses(engine: Any, steps: int) -> list[float]:
    out = []
    for step in range(steps):
        batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(step))
        out.append(float(engine.forward_backward([(batch[:, :-1], batch[:, 1:])])))
        engine.optimizer_step()
    return out


def test_zero3_builds_under_zero_init_loads_and_trains_as_the_whole_model(checkpoints: dict[str, Path],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed  # noqa: PLC0415

    monkeypatch.setenv("LOCAL_RANK", "0")  # the engine sets it for DeepSpeed: gone again after the test
    ds = _spec(checkpoints["bf16_tied"], strategy="deepspeed", deepspeed={"zeroStage": 3})
    with gloo_world_of_one():
        engine = make_engine(ds, build_model(ds.model, False, ds.seed, meta=True), torch.device("cpu"), 1)
        params = list(engine.model.parameters())
        assert all(hasattr(p, "ds_id") for p in params)  # partitioned by zero.Init, not wrapped afterwards
        with deepspeed.zero.GatheredParameters(params):
            _assert_same(_values(engine.model), build_model(ds.model, False, ds.seed))
        got = _losses(engine, 3)
    ddp = _spec(checkpoints["bf16_tied"], strategy="ddp")
    with gloo_world_of_one():
        want = _losses(make_engine(ddp, build_model(ddp.model, False, ddp.seed), torch.device("cpu"), 1), 3)
    assert got == pytest.approx(want, rel=1e-5)


def test_without_safetensors_each_rank_loads_whole_and_says_so(checkpoints: dict[str, Path], tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A pytorch_model.bin-only directory: no slices to read, so the whole model is loaded (in its own dtype)."""
    source = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["fp32"]))
    source.config.save_pretrained(str(tmp_path))
    torch.save(source.state_dict(), tmp_path / "pytorch_model.bin")
    spec = _spec(tmp_path)
    with gloo_world_of_one(), caplog.at_level(logging.WARNING, logger="kubetrain.trainer"):
        engine = make_engine(spec, build_model(spec.model, False, spec.seed, meta=True), torch.device("cpu"), 1)
        _assert_same(_values(engine.model), build_model(spec.model, False, spec.seed))
    assert "no *.safetensors files; every process loads the whole model" in caplog.text
