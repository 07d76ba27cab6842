"""One rank of a gang (tests/e2e/test_hf_sharded_load.py) that builds model.hfPath's model on the meta device, splits
and shards it as its spec says (the trainer's own engine), and loads it; then it compares with ``from_pretrained``'s
whole fp32 model and writes ``result-<rank>.json``: the parameters whose full tensor differs, both losses on one
batch, and how many elements this rank holds and read from the checkpoint's files.

    python hf_sharded_load_worker.py     (the trainer's environment: RANK, WORLD_SIZE, KUBETRAIN_CONFIG, ...)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import hf_storage

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.model import build_model
from kubetrain.trainer.parallel.engines import make_engine

READ: list[int] = []
"""Elements of every slice this process read from the safetensors files."""


def _counting(original: Any) -> Any:
    def read(self: Any, f: Any, req: Any, planner: Any) -> None:
        READ.append(int(torch.Size(req.lengths).numel()))
        original(self, f, req, planner)

    return read


def main() -> None:
    hf_storage.HuggingFaceStorageReader._process_read_request = _counting(  # type: ignore[method-assign]
        hf_storage.HuggingFaceStorageReader._process_read_request)
    dist.init_process_group("gloo")
    spec = TrainingJobSpec.model_validate(json.loads(Path(os.environ["KUBETRAIN_CONFIG"]).read_text()))
    engine = make_engine(spec, build_model(spec.model, False, spec.seed, meta=True), torch.device("cpu"),
                         dist.get_world_size())
    reference = build_model(spec.model, False, spec.seed)  # from_pretrained, whole, fp32
    want = dict(reference.named_parameters())
    differ, held = [], 0
    for name, p in engine.model.named_parameters():
        held += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        if not torch.equal(whole.detach(), want[name].detach()):
            differ.append(name)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        loss, want_loss = float(engine.eval_loss([(x, y)])), float(reference(x, y))
    result = {"differ": differ, "loss": loss, "reference_loss": want_loss, "held": held, "read": sum(READ),
              "total": sum(p.numel() for p in want.values())}
    Path(f"result-{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
