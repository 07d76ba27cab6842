"""Hugging Face models (model.hfPath) loaded sharded by 2 gloo processes: built on the meta device, split and
sharded, then each process reads only the slices it holds from the safetensors files (hf_sharded_load_worker.py).
The full tensors are exactly ``from_pretrained``'s and so is the loss (two gangs at once: 4 processes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from support.hf_models import tiny_causal_lm
from support.trainer_harness import Gang, tiny_spec

pytestmark = pytest.mark.e2e
pytest.importorskip("transformers")

WORKER = Path(__file__).parent / "hf_sharded_load_worker.py"
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "fsdp_bf16_tied_files": ({"dtype": "bfloat16", "tie_word_embeddings": True, "max_shard_size": "40KB"}, {}),
    "tensor_fp32": ({}, {"parallelism": {"tensor": 2}}),
}
"""name -> (how the tiny Llama is saved, the spec's layout over 2 processes): bf16 with the head tied to the
embeddings in several files (model.safetensors.index.json) under FSDP2; fp32 in one file under tensor parallelism
(each process holds its heads, the embeddings and the head whole)."""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("hf_sharded_load")
    gangs = {}
    for name, (saved, layout) in CASES.items():
        model = tiny_causal_lm(root / f"{name}_model", **saved)
        spec = tiny_spec(strategy="fsdp", model={"hfPath": str(model), "seqLen": 16}, **layout)
        gangs[name] = Gang(root / name, spec, 2, command=[sys.executable, str(WORKER)])
    out = {}
    for name, gang in gangs.items():
        run = gang.wait()
        assert run.exit_codes == [0, 0], run.log(0)[-3000:]
        out[name] = [json.loads((root / name / f"result-{r}.json").read_text()) for r in range(2)]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_each_process_reads_its_part_and_holds_from_pretrained_weights(results: dict[str, list[dict[str, Any]]],
                                                                      case: str) -> None:
    for rank, r in enumerate(results[case]):
        print(f"{case} rank {rank}: holds {r['held']} of {r['total']} elements, read {r['read']}; "
              f"loss {r['loss']:.7f} vs from_pretrained {r['reference_loss']:.7f}")
        assert r["differ"] == [], r["differ"]
        assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-6)
        assert r["read"] == r["held"]  # only what it keeps
        if case.startswith("fsdp"):
            assert r["held"] <= r["total"] // 2 + 1024  # half, but for FSDP2's padding of odd rows
