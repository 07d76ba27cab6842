"""spec.export: a committed checkpoint as a Hugging Face model directory that ``from_pretrained`` loads.

The export is read from a committed checkpoint, never from a live gang, so that the trainer at success and
``kubetrain export`` later are one path: the model is built whole on this process's CPU from model.hfPath
(LoRA adapters added as spec.lora says), the checkpoint's model state is loaded into it in one process
(torch.distributed.checkpoint without a process group, or DeepSpeed's own consolidation), and then written::

    export/                config.json, model*.safetensors (LoRA merged into the base), generation_config.json,
                           the tokenizer and its chat template, EXPORTED.json (what and from where)
    export/adapter/        the LoRA adapter alone (adapter_config.json, adapter_model.safetensors), with LoRA

The directory appears whole or not at all (written beside it, then renamed). The cost: one process holds the
whole model in fp32 on the host while exporting.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.checkpoint.directory import TRAINER_STATE
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.model import HFCausalLM, build_model
from kubetrain.trainer.parallel.engines import DeepSpeedEngine

log = logging.getLogger("kubetrain.trainer")

EXPORT_DIR = "export"
"""The export's directory name, under the checkpoint directory (and under checkpoint.uri)."""
ADAPTER_DIR = "adapter"
MARKER = "EXPORTED.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
"""What a Hugging Face tokenizer directory may hold; those present are copied beside the weights."""


def whole_model(spec: TrainingJobSpec) -> HFCausalLM:
    """model.hfPath's model on this process's CPU, fp32, with spec.lora's adapters: the structure (and so the
    parameter names) the checkpoint was written from."""
    if spec.model.hf_path is None:
        raise ConfigError("model.hfPath", "the export reads the base model from a local directory: set model.hfPath "
                          "(kubetrain export -f: a manifest naming local copies of the model and its tokenizer)")
    model = build_model(spec.model, activation_checkpointing=False, seed=spec.seed)
    assert isinstance(model, HFCausalLM)
    if spec.lora is not None:
        from kubetrain.trainer.lora import apply_lora  # noqa: PLC0415 - peft only for LoRA jobs

        apply_lora(model, spec.lora)
    return model


def load_saved_model(step_dir: Path, model: nn.Module) -> None:
    """Fill ``model`` with the model state of committed checkpoint ``step_dir``, read in this one process whatever
    the world size that wrote it: DCP's (ddp, fsdp) resharded into whole tensors, loaded in place (one copy of
    the model in memory), or DeepSpeed's ZeRO partitions consolidated."""
    if (step_dir / "dcp").is_dir():
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        dcp.load({"model": model.state_dict()}, checkpoint_id=str(step_dir / "dcp"), no_dist=True)
    elif (step_dir / DeepSpeedEngine.TAG).is_dir():
        model.load_state_dict(deepspeed_model_state(step_dir))
    else:
        raise ConfigError("export", f"{step_dir} holds no model state this trainer wrote (no dcp/ or "
                          f"{DeepSpeedEngine.TAG}/)")


def deepspeed_model_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """A DeepSpeed checkpoint's whole model state. ZeRO 0 keeps it in its model-states file; ZeRO 1-3 keep the
    trained parameters' fp32 values partitioned (zero_to_fp32 consolidates them). ZeRO 3 also lists the frozen
    parameters (LoRA's base weights); ZeRO 1 and 2 keep those whole in the model-states file only."""
    info = json.loads((step_dir / "deepspeed.json").read_text()) if (step_dir / "deepspeed.json").is_file() else {}
    stage = int(info.get("zero_stage", 1))
    state: dict[str, torch.Tensor] = {}
    if stage < 3:
        files = sorted((step_dir / DeepSpeedEngine.TAG).glob("mp_rank_*_model_states.pt"))
        # DeepSpeed pickles more than tensors here (its own config objects): read like its own loader does.
        state.update(torch.load(files[0], map_location="cpu", weights_only=False)["module"])
    if stage > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415

        state.update(get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag=DeepSpeedEngine.TAG))
    return state


def base_dtype(spec: TrainingJobSpec) -> torch.dtype:
    """The dtype model.hfPath's weights are published in (config.json's dtype / torch_dtype; fp32 unsaid)."""
    config = json.loads((Path(str(spec.model.hf_path)) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def tokenizer_dir(spec: TrainingJobSpec) -> Path | None:
    """Where the job's tokenizer files are: data.tokenizer's directory, else the model's own (if it has one)."""
    for candidate in (spec.data.tokenizer, spec.model.hf_path):
        if candidate and candidate != "byte" and (Path(candidate) / "tokenizer.json").is_file():
            return Path(candidate)
    return None


def write_hf(model: HFCausalLM, spec: TrainingJobSpec, out: Path, step: int) -> None:
    """``model`` (its checkpoint loaded) as a Hugging Face directory ``out``: the adapter alone first, then the
    merged weights in the base's dtype, the tokenizer files and EXPORTED.json."""
    inner: Any = model.inner
    if spec.lora is not None:
        inner.save_pretrained(str(out / ADAPTER_DIR))  # a PeftModel saves its adapter only
        inner = inner.merge_and_unload()
    inner.to(base_dtype(spec)).save_pretrained(str(out))
    source = tokenizer_dir(spec)
    for file in (source / name for name in TOKENIZER_FILES) if source is not None else ():
        if file.is_file():
            shutil.copy2(file, out / file.name)
    marker = {"step": step, "base": str(spec.model.hf_path), "lora": spec.lora is not None,
              "tokenizer": str(source) if source else None, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (out / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def export_checkpoint(step_dir: Path, spec: TrainingJobSpec, out: Path) -> Path:
    """Export committed checkpoint ``step_dir`` of a job with ``spec`` to ``out``: written beside it, then renamed
    into place. An ``out`` that exists is replaced only when it is an export (its EXPORTED.json) or empty."""
    if out.exists() and not (out / MARKER).is_file() and any(out.iterdir()):
        raise ConfigError("export", f"{out} exists and is not an export (no {MARKER}): name another directory")
    t0 = time.perf_counter()
    model = whole_model(spec)
    load_saved_model(step_dir, model)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_hf(model, spec, partial, int(json.loads((step_dir / TRAINER_STATE).read_text())["step"]))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    log.info("exported step %s to %s in %.1f s", step_dir.name, out, time.perf_counter() - t0)
    return out


def export_at_success(spec: TrainingJobSpec, root: Path, step: int) -> str:
    """Rank 0, once the final checkpoint (``step``) is committed: export it to ``<checkpoint dir>/export``; with
    checkpoint.uri, from the committed step downloaded beside it, and uploaded to ``<checkpoint.uri>/export``
    (the previous export there replaced). Where the export is: a directory or an s3:// URI."""
    from kubetrain.core.progress import checkpoint_dirname  # noqa: PLC0415

    out = root / EXPORT_DIR
    if spec.checkpoint.uri is None:
        return str(export_checkpoint(root / checkpoint_dirname(step), spec, out))
    from kubetrain.trainer.checkpoint.object_store import Bucket, files_under  # noqa: PLC0415 - s3fs: uri jobs

    bucket = Bucket.open(spec.checkpoint.uri, spec.s3)
    source = bucket.download(step, root / "export-source")
    try:
        export_checkpoint(source, spec, out)
    finally:
        shutil.rmtree(root / "export-source", ignore_errors=True)
    target = f"{bucket.uri}/{EXPORT_DIR}"
    if bucket.call("listing", bucket.fs.exists, target):
        bucket.call("delete", bucket.fs.rm, target, recursive=True)
    # The marker last: a reader that finds EXPORTED.json finds every file (a cut-off upload has none).
    local = [p for p in files_under(out) if p.name != MARKER]
    bucket.call("upload", bucket.fs.put, [str(p) for p in local],
                [f"{target}/{p.relative_to(out).as_posix()}" for p in local])
    bucket.call("upload", bucket.fs.put_file, str(out / MARKER), f"{target}/{MARKER}")
    log.info("uploaded the export to %s", target)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m kubetrain.trainer.export`` (what ``kubetrain export`` runs): exit 0 exported, 2 bad input."""
    import argparse  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from kubetrain.trainer.config import load_spec  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m kubetrain.trainer.export", description=main.__doc__)
    parser.add_argument("--config", type=Path, required=True, help="the job's spec (JSON, wire form)")
    parser.add_argument("--step-dir", type=Path, required=True, help="a committed step-N checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write (an earlier export replaced)")
    parser.add_argument("--cache", type=Path, help="a local run's cache: where its model.hfUri was fetched")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        spec = load_spec(args.config)
        if args.cache is not None and spec.model.hf_uri is not None:
            from kubetrain.trainer.data.fetch import resolved  # noqa: PLC0415

            spec = resolved(spec, args.cache)
        out = export_checkpoint(args.step_dir, spec, args.out)
    except ConfigError as exc:
        print(f"kubetrain export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.step_dir} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
