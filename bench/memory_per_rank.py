"""Peak host memory per rank, measured from outside: what a model costs each process of a gang.

    .venv/bin/python bench/memory_per_rank.py [--ranks 8] [--strategy fsdp] [--ga 1] [--ac] [--shape wide|deep] [--hf] [--repeats 1]
        [--out bench/results/X.json]

N trainer processes (gloo on CPU, tests/support/trainer_harness.py's Gang, OMP_NUM_THREADS=1) train a
~100M-parameter model, then the same job with a tiny one; for each rank the bench reads the process's peak
resident set (VmHWM in /proc/<pid>/status) from outside, polling, at the moment rank 0's losses.jsonl shows
step 2 (before the final checkpoint, which runs after the last step, 4). The difference between the two jobs'
per-rank peaks is what the model costs a rank beyond the runtime (torch, gloo, the data); it is reported as a
multiple of the model's full fp32 weights (4 bytes x parameters): sharded over N ranks FSDP2 keeps parameters,
gradients and AdamW's two moments, 4 x 4 / N bytes per parameter (0.5x for N = 8); a model built whole
before sharding costs above 1x.

- built-in model (``--shape``): ``wide`` dModel 768, nLayers 14, nHeads 12 (99.7M parameters) or ``deep``
  dModel 512, nLayers 32, nHeads 8 (101M), seqLen 128, byte vocabulary; the tiny one: tiny_spec's model.
- ``--hf``: a Llama (``--shape wide``: hidden 768, 12 layers, intermediate 2048: 97.5M parameters; ``deep``:
  hidden 512, 28 layers, intermediate 1408: 98.3M; vocabulary 8192, untied head) saved in bf16 with save_pretrained
  into a temporary directory and trained as model.hfPath; the tiny one: tests/support/hf_models.py's.
- ``--ga``: gradientAccumulationSteps (micro-batch 1): with FSDP2's sharded accumulation the peak does not
  grow with it.
- ``--ac``: activationCheckpointing, so that the difference is the model's states and the layout's transient
  buffers rather than its activations (without it a rank of the 100M model also keeps ~8 MB of activations per
  block and sequence for backward: 0.3x the weights at micro-batch 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from support.hf_models import tiny_causal_lm
from support.trainer_harness import Gang, read_records, tiny_spec  # bench/support: a link to tests/support

SHAPES = {"wide": {"dModel": 768, "nLayers": 14, "nHeads": 12, "seqLen": 128},
          "deep": {"dModel": 512, "nLayers": 32, "nHeads": 8, "seqLen": 128}}
"""Two ~100M-parameter built-in models: GPT-2-small-like (14 blocks) and deeper, narrower (32 blocks, as a 7B
model has). FSDP2's transient buffers are a few blocks' worth, so their share of the weights is 1/nLayers-ish."""
HF_SHAPES = {
    "wide": {"vocab_size": 8192, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64, "max_position_embeddings": 256},
    "deep": {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 28,
             "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 256},
}
"""~100M-parameter Llamas: 12 layers of 768 (97.5M) and 28 of 512 (98.3M)."""
AT_STEP = 2
STEPS = 4


def vm_hwm(pid: int) -> int | None:
    """The process's peak resident set in bytes, None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def job(args: argparse.Namespace, model: dict[str, Any]) -> dict[str, Any]:
    return tiny_spec(strategy=args.strategy, precision="fp32", microBatchSize=1, gradientAccumulationSteps=args.ga,
                     maxSteps=STEPS, workers=1, procsPerWorker=args.ranks, model=model,
                     activationCheckpointing=args.ac, checkpoint={"everySteps": 1000, "keep": 1})


def peaks_at_step(out: Path, spec: dict[str, Any], ranks: int) -> tuple[list[int], float]:
    """Every rank's VmHWM when rank 0 has logged step AT_STEP; the seconds that took."""
    gang = Gang(out, spec, ranks, timeout=3600)
    peaks: list[int] = [0] * ranks
    while True:
        for i, p in enumerate(gang.procs):
            peaks[i] = max(peaks[i], vm_hwm(p.pid) or 0)
        steps = [r["step"] for r in read_records(out)]
        if steps and max(steps) >= AT_STEP:
            break
        if any(p.poll() not in (None, 0) for p in gang.procs):
            raise SystemExit(f"a rank failed; its log: {(out / 'rank-0.log').read_text()[-3000:]}")
        time.sleep(0.05)
    seconds = time.monotonic() - gang.start
    run = gang.wait()
    if run.exit_codes != [0] * ranks:
        raise SystemExit(f"exit codes {run.exit_codes}; rank 0's log: {run.log(0)[-3000:]}")
    return peaks, seconds


def hf_model(root: Path, large: bool, shape: str = "wide") -> tuple[dict[str, Any], int]:
    """A Llama saved in bf16 (model.hfPath) and its parameter count."""
    import torch  # noqa: PLC0415 - bench-only, heavy
    import transformers  # noqa: PLC0415

    path = root / ("large" if large else "tiny")
    if large:
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model("llama", **HF_SHAPES[shape])
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
        model.save_pretrained(str(path))
        count = sum(p.numel() for p in model.parameters())
    else:
        tiny_causal_lm(path)
        count = 0
    return {"hfPath": str(path), "seqLen": 128}, count


def builtin_params(model: dict[str, Any]) -> int:
    """The built-in model's parameter count, from its shapes (built on the meta device: no storage)."""
    import torch  # noqa: PLC0415 - bench-only, heavy

    from kubetrain.core.api import ModelSpec  # noqa: PLC0415
    from kubetrain.trainer.model import Transformer  # noqa: PLC0415

    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(ModelSpec.model_validate(model), seed=None).parameters())


def measure(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    if args.hf:
        large, params = hf_model(root, True, args.shape)
        tiny, _ = hf_model(root, False)
    else:
        large = SHAPES[args.shape]
        params, tiny = builtin_params(large), tiny_spec()["model"]
    runs: dict[str, list[list[int]]] = {"large": [], "tiny": []}
    for r in range(args.repeats):
        for name, model in (("large", large), ("tiny", tiny)):
            peaks, seconds = peaks_at_step(root / f"{name}-{r}", job(args, model), args.ranks)
            runs[name].append(peaks)
            print(f"{name} #{r}: {seconds:.0f} s to step {AT_STEP}; peak MiB per rank "
                  f"{[round(p / 2**20) for p in peaks]}", flush=True)
    weights = 4 * params
    large_peak = [statistics.median(x) for x in zip(*runs["large"], strict=True)]
    tiny_peak = [statistics.median(x) for x in zip(*runs["tiny"], strict=True)]
    extra = [a - b for a, b in zip(large_peak, tiny_peak, strict=True)]
    return {"ranks": args.ranks, "strategy": args.strategy, "gradientAccumulationSteps": args.ga, "hf": args.hf,
            "activationCheckpointing": args.ac, "shape": args.shape,
            "parameters": params, "fp32WeightsBytes": weights, "largePeakBytes": large_peak,
            "tinyPeakBytes": tiny_peak, "extraPerRankBytes": extra,
            "extraOverWeights": {"max": max(extra) / weights, "median": statistics.median(extra) / weights},
            "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--ac", action="store_true", help="activationCheckpointing")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="wide")
    parser.add_argument("--hf", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="memory-per-rank-") as tmp:
        result = measure(args, Path(tmp))
    ratio = result["extraOverWeights"]
    print(f"{args.ranks} {args.strategy} ranks, {result['parameters'] / 1e6:.1f}M parameters "
          f"({result['fp32WeightsBytes'] / 2**20:.0f} MiB fp32), GA {args.ga}, AC {args.ac}: per-rank peak above the tiny model's "
          f"{[round(e / 2**20) for e in result['extraPerRankBytes']]} MiB = max {ratio['max']:.2f}x, "
          f"median {ratio['median']:.2f}x the fp32 weights")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
