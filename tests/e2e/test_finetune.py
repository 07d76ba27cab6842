"""Fine-tuning as users do it, through `kubetrain run`: a tiny Llama with a ChatML chat template, a chat JSONL, LoRA
rank 8, FSDP2 on 2 local processes, export.huggingFace. Rank 1 is killed after step 5: the run restarts its gang,
resumes from the step-4 checkpoint, Succeeds, and its losses after the resume equal an uninterrupted run's; the
export loads with from_pretrained, every LoRA target projection differs from the base and nothing else does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.hf_models import chat_tokenizer, tiny_causal_lm
from support.paths import EXAMPLE_DATA, REPO_ROOT
from support.trainer_harness import rel_diff, run_cli, tiny_job, tiny_spec

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

CHAT = REPO_ROOT / "examples" / "data-chat" / "chat.jsonl"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def manifest(root: Path, name: str, model: Path) -> Path:
    spec = tiny_spec(strategy="fsdp", workers=2, maxSteps=8, model={"hfPath": str(model), "seqLen": 96},
                     data={"path": str(CHAT), "format": "chat", "tokenizer": str(model)},
                     optimizer={"lr": 1e-2, "minLr": 1e-3, "warmupSteps": 1, "gradClip": 1.0},
                     lora={"rank": 8, "alpha": 16}, export={"huggingFace": True},
                     checkpoint={"everySteps": 2, "keep": 2, "asyncSave": False},
                     restartPolicy={"backoffLimit": 2, "backoffSeconds": 0})
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(tiny_job(name, spec)))
    return path


def losses(out: Path) -> dict[int, float]:
    """step -> loss of the run's losses.jsonl (a step trained again after the resume keeps its newer value)."""
    records = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("finetune")
    vocab = chat_tokenizer(root / "model", sorted(EXAMPLE_DATA.glob("*.txt")))
    model = tiny_causal_lm(root / "model", vocab_size=vocab, max_position_embeddings=128)
    done = {}
    for name, extra in (("straight", []), ("killed", ["--fail-at", "1:5"])):
        result = run_cli(["run", str(manifest(root, name, model)), "--output-dir", str(root / name), "-q",
                          "--summary-json", str(root / f"{name}.json"), *extra], timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        done[name] = json.loads((root / f"{name}.json").read_text())
    return model, done


def test_the_killed_run_succeeds_after_one_restart_and_trains_as_the_straight_one(runs) -> None:
    _, done = runs
    killed, straight = done["killed"], done["straight"]
    assert (killed["phase"], killed["restarts"], killed["resumed_from"]) == ("Succeeded", 1, [4])
    after = {s: v for s, v in losses(Path(killed["output_dir"])).items() if s > 4}
    reference = losses(Path(straight["output_dir"]))
    print(f"killed at step 5, resumed from 4: losses 5-8 {after}, uninterrupted {reference}, "
          f"largest relative difference {rel_diff(after, reference):.2e}")
    assert sorted(after) == [5, 6, 7, 8] and reference[8] < reference[1]
    assert rel_diff(after, reference) <= 1e-5, (after, reference)


def test_the_export_is_the_base_with_the_adapters_merged_into_their_projections_only(runs) -> None:
    model, done = runs
    export = Path(done["killed"]["export_dir"])
    assert export == Path(done["killed"]["output_dir"]) / "checkpoints" / "export"
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model)).state_dict()
    tuned = transformers.AutoModelForCausalLM.from_pretrained(str(export)).state_dict()
    assert set(tuned) == set(base)
    changed = sorted(n for n in base if not (tuned[n] == base[n]).all())
    print(f"export {export}: {len(changed)} of {len(base)} tensors differ from the base: {changed}")
    assert changed == sorted(n for n in base if n.endswith(tuple(f"{t}.weight" for t in TARGETS)))
    assert "model.embed_tokens.weight" not in changed and "lm_head.weight" not in changed
    assert json.loads((export / "adapter" / "adapter_config.json").read_text())["r"] == 8
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"
