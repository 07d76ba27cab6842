"""spec.export and `kubetrain export`: a committed checkpoint as a Hugging Face directory that from_pretrained loads.

A tiny Llama (fp32, built here) is fine-tuned on 2 gloo processes under DeepSpeed ZeRO-3 (its partitions are
consolidated, the hardest of the formats to read back) with export.huggingFace: the export's weights are those the
gang trained (their global norm equals the one rank 0 logged at the last step), and `kubetrain export` writes an
earlier committed step on demand. LoRA under ZeRO-1, whose checkpoints keep the frozen weights apart from the
partitioned trained ones, exports the base with the adapters merged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.hf_models import tiny_causal_lm
from support.trainer_harness import Run, run_cli, run_trainer, tiny_spec

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    root = tmp_path_factory.mktemp("export")
    model = tiny_causal_lm(root / "model")
    spec = tiny_spec(strategy="deepspeed", deepspeed={"zeroStage": 3}, maxSteps=4, export={"huggingFace": True},
                     model={"hfPath": str(model), "seqLen": 32}, checkpoint={"everySteps": 2, "keep": 3})
    return model, run_trainer(root / "out", spec, env={"KUBETRAIN_DEBUG_PARAM_NORM": "1"})


def weights(directory: Path | str) -> dict[str, torch.Tensor]:
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory)).state_dict()


def norm(state: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().pow(2).sum() for t in state.values()) ** 0.5)


def test_the_export_at_success_holds_the_weights_the_gang_trained(trained: tuple[Path, Run]) -> None:
    model, run = trained
    assert run.exit_codes == [0, 0], run.log()
    export = Path(run.progress["export"])
    assert export == run.ckpt_dir / "export" and not (run.ckpt_dir / "export.partial").exists()
    assert json.loads((export / "EXPORTED.json").read_text())["step"] == 4
    got, base = weights(export), weights(model)
    assert set(got) == set(base)
    assert all(not torch.equal(got[name], base[name]) for name in base)  # every weight trained
    assert norm(got) == pytest.approx(run.per_step("param_norm")[4], rel=1e-6)


def test_kubetrain_export_writes_an_earlier_committed_step(trained: tuple[Path, Run], tmp_path: Path) -> None:
    _, run = trained
    result = run_cli(["export", str(run.ckpt_dir), "-f", str(run.out / "config-0.json"), "--step", "2",
                      "-o", str(tmp_path / "step2")], timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"to {tmp_path / 'step2'}" in result.stdout
    assert norm(weights(tmp_path / "step2")) == pytest.approx(run.per_step("param_norm")[2], rel=1e-6)


def test_kubetrain_export_names_what_is_missing(trained: tuple[Path, Run], tmp_path: Path) -> None:
    _, run = trained
    missing = run_cli(["export", str(run.ckpt_dir), "--step", "3", "-f", str(run.out / "config-0.json")])
    assert missing.returncode == 2 and f"no committed checkpoint of step 3 in {run.ckpt_dir}" in missing.stderr
    no_manifest = run_cli(["export", str(run.ckpt_dir)])
    assert no_manifest.returncode == 2 and "the job's manifest is needed (-f FILE)" in no_manifest.stderr


def test_a_lora_job_under_zero_1_exports_its_frozen_base_with_the_adapters_merged(tmp_path: Path) -> None:
    model = tiny_causal_lm(tmp_path / "model")
    spec = tiny_spec(strategy="deepspeed", deepspeed={"zeroStage": 1}, maxSteps=2, export={"huggingFace": True},
                     model={"hfPath": str(model), "seqLen": 32}, lora={"rank": 4, "targetModules": ["q_proj"]})
    run = run_trainer(tmp_path / "out", spec)
    assert run.exit_codes == [0, 0], run.log()
    base, got = weights(model), weights(run.progress["export"])
    changed = sorted(name for name in base if not torch.equal(got[name], base[name]))
    assert changed == ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"]


def test_kubetrain_export_never_replaces_what_is_not_an_export(trained: tuple[Path, Run], tmp_path: Path) -> None:
    _, run = trained
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    refused = run_cli(["export", str(run.ckpt_dir), "-f", str(run.out / "config-0.json"), "-o", str(tmp_path / "mine")])
    assert refused.returncode == 2 and "exists and is not an export (no EXPORTED.json)" in refused.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
