"""Tiny randomly initialised Hugging Face causal LMs saved to a directory (model.hfPath), built here: nothing is
downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BYTE_VOCAB = 256
"""The byte tokenizer's vocabulary: a model of this size trains on data.tokenizer `byte`."""


def tiny_causal_lm(out: Path, model_type: str = "llama", dtype: str = "float32", max_shard_size: str | None = None,
                   **config: Any) -> Path:
    """A 2-layer causal LM of ``model_type`` (hidden 64, 4 query heads of 16 sharing 2 key/value heads, byte
    vocabulary), with ``config``'s overrides, saved with save_pretrained to ``out``: its weights in ``dtype``
    ("bfloat16": as most published checkpoints), in files of at most ``max_shard_size`` ("40KB": several, with a
    model.safetensors.index.json)."""
    import torch  # noqa: PLC0415 - the tests that need these import them, the others stay light
    import transformers  # noqa: PLC0415

    settings: dict[str, Any] = {
        "vocab_size": BYTE_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64, **config,
    }
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **settings))
    model.to(getattr(torch, dtype)).save_pretrained(str(out), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return out


def bpe_tokenizer(out: Path, corpus: list[Path], vocab_size: int = 300) -> int:
    """A byte-level BPE tokenizer trained on ``corpus`` with ``vocab_size`` ids, saved as ``out``/tokenizer.json
    (what data.tokenizer reads); its vocabulary size."""
    import tokenizers  # noqa: PLC0415

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in corpus], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return int(tok.get_vocab_size())


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML chat template (as Qwen's and many others' are): `<|im_start|>role\\ncontent<|im_end|>\\n` a message."""


def chat_tokenizer(out: Path, corpus: list[Path], vocab_size: int = 300, template: str = CHATML_TEMPLATE) -> int:
    """:func:`bpe_tokenizer` with ChatML's markers as special tokens and a tokenizer_config.json holding
    ``template`` as its chat_template and `<|im_end|>` as its EOS: a directory data.format chat renders with;
    its vocabulary size (the markers included)."""
    import json  # noqa: PLC0415

    import tokenizers  # noqa: PLC0415

    bpe_tokenizer(out, corpus, vocab_size)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": "<|im_end|>",
    }))
    return int(tok.get_vocab_size())
