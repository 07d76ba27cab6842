"""A Hugging Face Trainer script as a user has it: no kubetrain import at all.

A small Llama-style causal LM, built from a config (nothing is downloaded), trained on local text read as
UTF-8 bytes (vocabulary 256, no tokenizer). It runs as a kubetrain custom command unchanged: the Trainer
reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, which kubetrain sets for every rank. The
only kubetrain-aware line is where checkpoints go: $KUBETRAIN_CHECKPOINT_DIR (the job's checkpoint volume in
a pod) when set. After a restart it resumes through transformers' own get_last_checkpoint.

    python plain.py [--max-steps 40] [--save-steps 10] [--data DIR]

train.py is this script plus kubetrain's callback and resume helper.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

DATA = Path(__file__).resolve().parent.parent / "data"
"""examples/data here; /workspace/data in the trainer image, which ships this folder as /workspace/hf-trainer."""
SEQ_LEN = 64


class ByteText(Dataset[dict[str, torch.Tensor]]):
    """Fixed-length windows of a text's UTF-8 bytes; the labels are the inputs (the model shifts them)."""

    def __init__(self, data: bytes, seq_len: int = SEQ_LEN) -> None:
        self.ids = torch.tensor(list(data), dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.ids) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[i * self.seq_len:(i + 1) * self.seq_len]
        return {"input_ids": window, "labels": window.clone()}


def read_text(path: Path) -> bytes:
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise SystemExit(f"no *.txt under {path}")
    return b"".join(f.read_bytes() for f in files)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--save-steps", type=int, default=10)
    ap.add_argument("--eval-steps", type=int, default=0, help="0: no evaluation")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--output-dir", default=os.environ.get("KUBETRAIN_CHECKPOINT_DIR", "hf-out"))
    return ap.parse_args(argv)


def build_trainer(args: argparse.Namespace, callbacks: list[TrainerCallback] | None = None) -> Trainer:
    """A ~70k-parameter Llama and the Trainer around it: minutes of CPU at most, seconds for the tests."""
    text = read_text(args.data)
    cut = len(text) * 95 // 100  # the last 5% held out for evaluation
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ_LEN)
    torch.manual_seed(0)
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8,
        learning_rate=3e-3, warmup_steps=2, lr_scheduler_type="cosine", logging_steps=1,
        save_steps=args.save_steps, save_total_limit=3,
        eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None,
        per_device_eval_batch_size=8, report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        seed=0, use_cpu=not torch.cuda.is_available(),
    )
    return Trainer(model=LlamaForCausalLM(config), args=targs, train_dataset=ByteText(text[:cut]),
                   eval_dataset=ByteText(text[cut:][:SEQ_LEN * 16]) if args.eval_steps else None,
                   callbacks=callbacks)


def main() -> None:
    args = parse_args()
    trainer = build_trainer(args)
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    if last and int(os.environ.get("RANK", "0")) == 0:
        print(f"resuming from {last}", flush=True)
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
