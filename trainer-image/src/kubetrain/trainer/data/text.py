"""Byte-level text data with deterministic, resumable sampling.

The batch of optimizer step ``s`` is a pure function of ``(seed, s)`` and the global
batch size ``G = microBatchSize × gradientAccumulationSteps × worldSize``: G random
windows of ``seqLen + 1`` bytes are drawn from the concatenated corpus, then split
into contiguous per-rank chunks and each chunk into contiguous micro-batches. So a
resumed run sees exactly the batches it would have seen, and accumulating 2 micro
batches of b equals one micro batch of 2b (same samples on the same rank).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from kubetrain.core.api import DataSpec, TrainingJobSpec
from kubetrain.trainer.config import ConfigError

_MIX = 0x9E3779B97F4A7C15


def data_files(spec: DataSpec, field: str = "data.path") -> list[Path]:
    root = Path(spec.path)
    if root.is_file():
        return [root]
    if root.is_dir():
        files = sorted(p for p in root.rglob(spec.glob) if p.is_file())
        if not files:
            raise ConfigError("data.glob", f"no files match {spec.glob!r} under {root}")
        return files
    raise ConfigError(field, f"{root} does not exist")


def load_corpus(spec: DataSpec, seq_len: int, field: str = "data.path") -> torch.Tensor:
    """All files' text in sorted order as token ids: UTF-8 bytes (a uint8 tensor) for the byte tokenizer,
    else the Hugging Face tokenizer's ids (int32)."""
    chunks = [p.read_bytes() for p in data_files(spec, field)]
    blob = b"\n".join(chunks)
    if spec.tokenizer == "byte":
        ids = torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()
    else:
        ids = torch.tensor(hf_tokenizer(spec.tokenizer).encode(blob.decode("utf-8", errors="replace")).ids,
                           dtype=torch.int32)
    if ids.numel() < seq_len + 2:
        raise ConfigError(field, f"only {ids.numel()} tokens of text; need more than seqLen+1 = {seq_len + 1}")
    return ids


def hf_tokenizer(directory: str) -> Any:
    """A Hugging Face tokenizer from a local directory's tokenizer.json (the `tokenizers` package)."""
    path = Path(directory) / "tokenizer.json"
    if importlib.util.find_spec("tokenizers") is None:
        raise ConfigError("data.tokenizer", "needs the `tokenizers` package, which is not installed in this image")
    if not path.is_file():
        raise ConfigError("data.tokenizer", f"{path} does not exist (`byte`, or a directory with a tokenizer.json)")
    from tokenizers import Tokenizer  # noqa: PLC0415 - optional dependency

    return Tokenizer.from_file(str(path))


HELD_OUT_FRACTION = 0.05
"""Of the training text, the tail held out for evaluation when evalEverySteps is set without data.evalPath."""
EVAL_STEP = -1
"""The sampler step whose windows are the evaluation set: the same at every evaluation, never a training step."""


def split_eval(corpus: torch.Tensor, spec: TrainingJobSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(training text, evaluation text): data.evalPath's text, else the last HELD_OUT_FRACTION of the
    training text, which is then not trained on. No evaluation text without evalEverySteps."""
    if spec.eval_every_steps is None:
        return corpus, None
    need = spec.model.seq_len + 2
    if spec.data.eval_path is not None:
        held = load_corpus(spec.data.model_copy(update={"path": spec.data.eval_path}), spec.model.seq_len,
                           field="data.evalPath")
        return corpus, held
    cut = int(corpus.numel() * (1 - HELD_OUT_FRACTION))
    if corpus.numel() - cut < need or cut < need:
        raise ConfigError("spec.evalEverySteps", f"holding out {HELD_OUT_FRACTION:.0%} of {corpus.numel()} bytes of "
                          f"text leaves less than seqLen+2 = {need} for training or evaluation: set data.evalPath")
    return corpus[:cut], corpus[cut:]


def eval_batches(held: torch.Tensor, spec: TrainingJobSpec, world_size: int, rank: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the fixed evaluation windows: evalBatches micro-batches of microBatchSize."""
    sampler = Sampler(held, spec.model.seq_len, spec.seed)
    return sampler.micro_batches(EVAL_STEP, spec.micro_batch_size, spec.eval_batches, world_size, rank)


def step_seed(seed: int, step: int) -> int:
    return (seed * _MIX + step * 0x632BE59BD9B4E019 + 1) % (2**63 - 1)


class Sampler:
    """Batches as a pure function of (seed, step)."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, seed: int) -> None:
        self.corpus = corpus
        self.seq_len = seq_len
        self.seed = seed

    def global_offsets(self, step: int, global_batch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(step_seed(self.seed, step))
        return torch.randint(0, self.corpus.numel() - self.seq_len - 1, (global_batch,), generator=gen)

    def micro_batches(
        self, step: int, micro_batch: int, grad_accum: int, world_size: int, rank: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tokens, targets) int64 tensors of shape [micro_batch, seqLen], one pair per micro-batch."""
        per_rank = micro_batch * grad_accum
        offsets = self.global_offsets(step, per_rank * world_size)[rank * per_rank : (rank + 1) * per_rank]
        idx = offsets[:, None] + torch.arange(self.seq_len + 1)[None, :]
        return split_micro_batches(self.corpus[idx].long(), micro_batch, grad_accum)

    def close(self) -> None:
        """Nothing to release (stream.ShardStream, its counterpart for data.uri, stops a thread)."""


def split_micro_batches(windows: torch.Tensor, micro_batch: int, grad_accum: int
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[micro_batch × grad_accum, seqLen+1] windows as grad_accum (tokens, targets) pairs of [micro_batch, seqLen]."""
    out = []
    for m in range(grad_accum):
        w = windows[m * micro_batch : (m + 1) * micro_batch]
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out
