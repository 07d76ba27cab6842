"""DeepSpeed ZeRO-3 applies kubetrain's generated defaults as meant (one process, gloo, CPU)."""

from __future__ import annotations

import torch
from support.process_group import gloo_world_of_one
from support.trainer_harness import tiny_spec

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.data.text import Sampler, load_corpus
from kubetrain.trainer.loop import train_step
from kubetrain.trainer.model import build_model, transformer_blocks
from kubetrain.trainer.parallel.engines import DeepSpeedEngine, make_engine


def test_zero3_at_world_size_one_fetches_whole_blocks_and_keeps_parameters_resident() -> None:
    from deepspeed.utils import z3_leaf_module  # noqa: PLC0415 - heavy import, this test only

    linear = torch.nn.functional.linear
    spec = TrainingJobSpec.model_validate(tiny_spec(strategy="deepspeed", deepspeed={"zeroStage": 3}))
    model = build_model(spec.model, False, spec.seed)
    with gloo_world_of_one():
        engine = make_engine(spec, model, torch.device("cpu"), 1)
        assert isinstance(engine, DeepSpeedEngine)
        sampler = Sampler(load_corpus(spec.data, spec.model.seq_len), spec.model.seq_len, spec.seed)
        batches = sampler.micro_batches(0, spec.micro_batch_size, spec.gradient_accumulation_steps, 1, 0)
        loss, _lr, _info = train_step(engine, batches)
        blocks = transformer_blocks(engine.model)
        assert blocks and all(z3_leaf_module(b) for b in blocks)  # one fetch / release per block
        assert not any(z3_leaf_module(m) for b in blocks for m in b.modules() if m is not b)
        assert all(p.ds_persist for p in engine.model.parameters())  # no gather / release at all
        assert torch.nn.functional.linear is linear  # DeepSpeed's process-wide linear replacement stays off
        assert torch.isfinite(loss)
