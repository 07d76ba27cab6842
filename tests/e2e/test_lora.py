"""spec.lora: LoRA adapters on a tiny Llama (built here, byte vocabulary), trained by the trainer on 2 gloo
processes: under FSDP2 killed on rank 1 mid-run and resumed exactly; under DDP (with activation checkpointing)
and DeepSpeed ZeRO-3 the same run, the same losses. The final FSDP2 checkpoint holds the base weights exactly as
model.hfPath's files and adapters that moved away from their initial values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.dcp_files import read_dcp
from support.hf_models import tiny_causal_lm
from support.trainer_harness import Gang, Run, rel_diff, resumed_losses, tiny_spec

from kubetrain.trainer.lora import checkpoint_name, is_adapter

pytestmark = pytest.mark.e2e
pytest.importorskip("transformers")
pytest.importorskip("peft")

STEPS = 8
EVERY = 3
"""Checkpoint every 3 steps; the kill comes after step 4 on rank 1, so the gang resumes from step 3."""
LAYOUTS: dict[str, dict[str, Any]] = {
    "fsdp": {"strategy": "fsdp"},
    "ddp": {"strategy": "ddp", "activationCheckpointing": True},
    "ds3": {"strategy": "deepspeed", "deepspeed": {"zeroStage": 3}},
}


def spec(model_dir: Path, name: str) -> dict[str, Any]:
    # Synchronous saves: the step-3 checkpoint is committed before the failure at step 4 (as test_hf_model.py).
    return tiny_spec(maxSteps=STEPS, model={"hfPath": str(model_dir), "seqLen": 32},
                     lora={"rank": 8, "alpha": 16}, optimizer={"lr": 1e-2, "warmupSteps": 1},
                     checkpoint={"everySteps": EVERY, "keep": 3, "asyncSave": False}, **LAYOUTS[name])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_causal_lm(tmp_path_factory.mktemp("lora") / "model")


@pytest.fixture(scope="module")
def runs(model_dir: Path) -> dict[str, Run]:
    root = model_dir.parent
    gangs = {name: Gang(root / name, spec(model_dir, name)) for name in LAYOUTS}
    gangs["fsdp_fail"] = Gang(root / "fsdp_fail", spec(model_dir, "fsdp"), env={"KUBETRAIN_FAIL_AT": "1:4"})
    done = {name: g.wait() for name, g in gangs.items()}
    done["fsdp_resumed"] = Gang(root / "fsdp_fail", spec(model_dir, "fsdp"), generation=1).wait()
    return done


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_adapters_train(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert run.exit_codes == [0, 0], run.log()[-3000:]
    losses = run.losses
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.1, losses
    assert "lora: rank 8, alpha 16, on all-linear layers of the blocks; trainable " in run.log(0)


@pytest.mark.parametrize("name", ["ddp", "ds3"])
def test_every_strategy_trains_the_same_adapters_from_the_same_start(runs: dict[str, Run], name: str) -> None:
    """The adapters' initial values are drawn whole from (seed, name) and cut: no strategy or sharding changes them,
    nor the steps after (fp32; ddp recomputes its blocks under activation checkpointing)."""
    assert rel_diff(runs[name].losses, runs["fsdp"].losses) <= 1e-5, (runs[name].losses, runs["fsdp"].losses)


def test_lora_resumes_exactly_after_a_kill(runs: dict[str, Run]) -> None:
    assert resumed_losses(runs, "fsdp", EVERY, STEPS) <= 1e-5
    assert rel_diff(runs["fsdp_resumed"].losses, runs["fsdp"].losses) <= 1e-5


def test_the_checkpoint_holds_the_base_weights_unchanged_and_trained_adapters(runs: dict[str, Run],
                                                                             model_dir: Path) -> None:
    from safetensors.torch import load_file  # noqa: PLC0415

    base = load_file(str(model_dir / "model.safetensors"))
    state = read_dcp(runs["fsdp"].ckpt_dir / f"step-{STEPS:08d}" / "dcp")
    model = {k.removeprefix("inner."): v for k, v in state["model"].items()}  # names below HFCausalLM.inner
    frozen = {checkpoint_name(k): v for k, v in model.items() if not is_adapter(k)}
    assert frozen.keys() == base.keys()
    assert all(torch.equal(frozen[k], base[k]) for k in base), "a base weight changed"
    adapters = {k: v for k, v in model.items() if is_adapter(k)}
    assert len(adapters) == 2 * 7 * 2  # lora_A and lora_B of 7 linear layers in each of 2 blocks
    assert all(v.abs().max() > 0 for k, v in adapters.items() if ".lora_B." in k), "lora_B still zero"
    assert sorted(state["optim"]["state"]) == sorted(f"inner.{k}" for k in adapters)  # AdamW's: adapters' only
