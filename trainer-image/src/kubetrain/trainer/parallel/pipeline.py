"""Pipeline parallelism for the built-in model: its blocks split into P stages, run by a torch schedule.

Every rank builds the whole model on the meta device (no storage), then deletes what its stage does not own
(parallel.materialize gives the rest storage afterwards): the first stage keeps
the embeddings, the last the final norm, the head and the loss, and each its run of blocks under their
original indices. The parameters keep the whole model's names, so a checkpoint written by one layout is
read by any other (DCP matches names, then reshards). The step's micro-batches (gradientAccumulationSteps
of them) flow through ``torch.distributed.pipelining``'s GPipe, 1F1B or interleaved 1F1B schedule over the
mesh's pp group; FSDP2 shards each stage over dp as without pipelining. Interleaved 1F1B gives each rank
VIRTUAL_STAGES stages (rank r runs stages r, r + P, ...): smaller stages, a smaller bubble, more sends.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.model import Transformer, lm_loss

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

VIRTUAL_STAGES = 2
"""Stages per rank under Interleaved1F1B (1 under the others)."""

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def virtual_stages(schedule: str) -> int:
    """Stages per rank for a spec.parallelism.pipelineSchedule (each names torch's schedule class)."""
    return VIRTUAL_STAGES if schedule == "Interleaved1F1B" else 1


def rank_stages(pp_rank: int, pipeline: int, schedule: str) -> list[int]:
    """The stages a pp rank runs, in model order: its own, or every P-th from its own (interleaved)."""
    return [pp_rank + k * pipeline for k in range(virtual_stages(schedule))]


def stage_blocks(n_layers: int, stages: int, stage: int) -> range:
    """The blocks ``stage`` runs: consecutive runs as even as they come, the first stages taking one more
    when ``stages`` does not divide ``n_layers`` (they also hold the embeddings, which cost little compute;
    the last stage holds the head, which costs a block's worth or more)."""
    if not 1 <= stages <= n_layers:
        raise ConfigError("parallelism.pipeline", f"{stages} stages cannot split model.nLayers {n_layers}")
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def split_stage(model: nn.Module, stage: int, stages: int) -> Transformer:
    """``model`` cut in place down to ``stage``'s part (deleted, not renamed: the names stay the whole model's)."""
    if not isinstance(model, Transformer):
        raise ConfigError("parallelism.pipeline", "pipeline parallelism supports the built-in model only (not model.hfPath)")
    own = stage_blocks(model.n_layers, stages, stage)
    model.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in own})
    if stage > 0:
        model.tok = model.pos = None
    if stage < stages - 1:
        model.ln_f = model.head = None
    return model


def split_stages(model: nn.Module, stages: list[int], total: int) -> list[Transformer]:
    """One module per stage in ``stages``, each cut from its own copy of ``model`` (the last from ``model``)."""
    copies = [copy.deepcopy(model) for _ in stages[1:]] + [model]
    return [split_stage(m, s, total) for m, s in zip(copies, stages, strict=True)]


class RankPart(nn.Module):
    """A rank's stages as one module under the whole model's names (``blocks.<i>``, ``tok``, ``head``...):
    what the optimizer, the clipping norm and the checkpoints see. It is never called: the stages are."""

    def __init__(self, stages: list[Transformer]) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({name: b for stage in stages for name, b in stage.blocks.items()})
        for name in ("tok", "pos", "ln_f", "head"):
            owners = [getattr(stage, name) for stage in stages if getattr(stage, name) is not None]
            if owners:
                self.add_module(name, owners[0])


class Pipeline:
    """One rank's stages and the schedule that runs the step's micro-batches through all stages."""

    def __init__(self, modules: list[Transformer], stages: list[int], mesh: DeviceMesh, device: torch.device,
                 schedule: str, micro_batches: int) -> None:
        from torch.distributed.pipelining import PipelineStage  # noqa: PLC0415
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class  # noqa: PLC0415

        self.modules, self.stages, self.device, self.group = modules, stages, device, mesh.get_group()
        self.pp_size = mesh.size()
        self.total = self.pp_size * len(stages)
        self.d_model = modules[0].d_model
        runners = [PipelineStage(m, s, self.total, device, group=self.group)
                   for m, s in zip(modules, stages, strict=True)]
        cls = get_schedule_class(schedule)
        # The loss of each micro-batch is its mean (as one process's), and the schedule divides the
        # gradients by the micro-batches (scale_grads): the step's gradient is their mean, as without.
        first = runners[0] if issubclass(cls, PipelineScheduleSingle) else runners
        self.schedule = cls(first, n_microbatches=micro_batches, loss_fn=lm_loss, scale_grads=True)

    @property
    def is_first(self) -> bool:
        return self.stages[0] == 0

    @property
    def is_last(self) -> bool:
        """Only the last stage computes a loss: the loop weighs the other ranks' (zero) losses out."""
        return self.stages[-1] == self.total - 1

    def train_step(self, micro_batches: Batches) -> torch.Tensor:
        """Forward and backward of the micro-batches (one batch, which the schedule chunks back into them);
        the mean loss on the last stage's ranks, 0 elsewhere."""
        args = (torch.cat([x for x, _ in micro_batches]).to(self.device),) if self.is_first else ()
        losses: list[torch.Tensor] = []
        if self.is_last:
            target = torch.cat([y for _, y in micro_batches]).to(self.device)
            self.schedule.step(*args, target=target, losses=losses)
        else:
            self.schedule.step(*args)
        return self._mean(losses)

    def _mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        # Summed in micro-batch order, then divided, as the data-parallel engine does.
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for loss in losses:
            total += loss.detach().float()
        return total / len(losses) if losses else total

    def eval_loss(self, micro_batches: Batches) -> torch.Tensor:
        """Forward only, one micro-batch at a time passed stage to stage (eval batches need not number the
        step's micro-batches, which the schedule was built for); the mean loss on the last stage, else 0."""
        losses: list[torch.Tensor] = []
        with torch.no_grad():
            for x, y in micro_batches:
                for module, stage in zip(self.modules, self.stages, strict=True):
                    h = x.to(self.device) if stage == 0 else self._receive(x, stage - 1)
                    if stage == self.total - 1:
                        losses.append(module(h, y.to(self.device)))
                    else:
                        out = module(h).float().contiguous()  # fp32 on the wire, whatever the compute dtype
                        dist.send(out, dst=self._rank_of(stage + 1), group=self.group)
        return self._mean(losses)

    def _rank_of(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage % self.pp_size)

    def _receive(self, tokens: torch.Tensor, stage: int) -> torch.Tensor:
        h = torch.empty((*tokens.shape, self.d_model), dtype=torch.float32, device=self.device)
        dist.recv(h, src=self._rank_of(stage), group=self.group)
        return h
