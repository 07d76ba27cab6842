"""A Hugging Face causal LM with its own tokenizer, both built here from nothing (a tiny Llama config and a
BPE tokenizer trained on examples/data, saved to a directory: nothing is downloaded), trained by the
trainer under FSDP2 and DeepSpeed ZeRO-3 on 2 gloo processes, killed and resumed exactly (fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.paths import EXAMPLE_DATA
from support.trainer_harness import Gang, Run, rel_diff, tiny_spec

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 300
FAIL_AT = {"fsdp": "1:4", "ds3": "0:5"}
"""rank:step of the injected failure; the newest checkpoint before it is step 3."""


def build_model_dir(out: Path) -> Path:
    """tokenizer.json (byte-level BPE, VOCAB ids, trained on the example corpus) and a 2-layer Llama."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted(EXAMPLE_DATA.glob("*.txt"))], trainer)
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(str(out))
    return out


def spec(model_dir: Path, strategy: str) -> dict[str, Any]:
    extra: dict[str, Any] = {"deepspeed": {"zeroStage": 3}} if strategy == "ds3" else {}
    # Synchronous saves: the step-3 checkpoint is committed before step 4, where the failure comes (a background
    # write commits at a later step's all-reduce, which a failure at step 4 never reaches: test_async_checkpoint).
    return tiny_spec(strategy="deepspeed" if strategy == "ds3" else strategy, maxSteps=8,
                     model={"hfPath": str(model_dir), "seqLen": 32}, data={"tokenizer": str(model_dir)},
                     checkpoint={"everySteps": 3, "keep": 3, "asyncSave": False}, **extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("hf")
    model_dir = build_model_dir(root / "model")
    gangs = {name: Gang(root / name, spec(model_dir, name)) for name in FAIL_AT}
    gangs.update({f"{name}_fail": Gang(root / f"{name}_fail", spec(model_dir, name), env={"KUBETRAIN_FAIL_AT": at})
                  for name, at in FAIL_AT.items()})
    done = {name: g.wait() for name, g in gangs.items()}
    resumed = {f"{name}_resumed": Gang(root / f"{name}_fail", spec(model_dir, name), generation=1) for name in FAIL_AT}
    done.update({name: g.wait() for name, g in resumed.items()})
    return done


@pytest.mark.parametrize("name", list(FAIL_AT))
def test_hf_model_with_its_tokenizer_trains(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert run.exit_codes == [0, 0], run.log()
    losses = run.losses
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1]
    assert losses[1] == pytest.approx(5.7, abs=0.3)  # ln(300): the ids are the tokenizer's, not bytes


@pytest.mark.parametrize("name", list(FAIL_AT))
def test_hf_model_resumes_exactly_after_a_kill(runs: dict[str, Run], name: str) -> None:
    resumed = runs[f"{name}_resumed"]
    assert resumed.exit_codes == [0, 0], resumed.log()
    assert resumed.progress["resumedFrom"] == 3
    assert rel_diff(resumed.losses, runs[name].losses) <= 1e-5, (resumed.losses, runs[name].losses)
