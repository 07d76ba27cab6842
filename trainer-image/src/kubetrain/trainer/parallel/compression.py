"""DDP gradient compression (``ddp.gradientCompression: powersgd``): torch's PowerSGD comm hook, the bytes
it all-reduces, and its state in checkpoints.

PowerSGD keeps its memories (the error feedback and the warm-started Q factors) per DDP bucket. DDP
lays its buckets out again after the first step of every process (one bucket at first, then the
order in which gradients become ready), so a resumed process sees other buckets than the one that
saved. The state is therefore saved per parameter, and laid out again for whatever bucket DDP hands
the hook. (``PowerSGDState.__getstate__`` drops only the process group: it keeps the bucket-keyed
dicts, which is why it is not used as the checkpoint format.)
"""

# No `from __future__ import annotations`: DDP's register_comm_hook checks the hook's annotations
# against dist.GradBucket and torch.futures.Future at run time, and strings fail that check.
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from kubetrain.core.api import DDPSpec
from kubetrain.trainer.checkpoint.safe_load import safe_load

log = logging.getLogger("kubetrain.trainer")

STATE_DIR = "powersgd"
"""Checkpoint subdirectory: one file per rank (the error feedback is each rank's own)."""


@dataclass(frozen=True)
class Slot:
    """One parameter's gradient inside a bucket."""

    param: int
    """Index in ``model.parameters()``."""
    offset: int
    """Start in the bucket's flat buffer (elements)."""
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass
class ParamState:
    """PowerSGD memories per parameter: the layout-free form (checkpoints, bucket rebuilds)."""

    errors: dict[int, torch.Tensor] = field(default_factory=dict)
    qs: dict[int, torch.Tensor] = field(default_factory=dict)


def q_slots(layout: list[Slot], rank: int, min_rate: float) -> Iterator[tuple[Slot, int, int, int]]:
    """(slot, Q start, Q length, P length) of each compressed gradient, in the order powerSGD_hook packs
    its P and Q memories: grouped by matrix shape (first seen first), bucket order within a group."""
    groups: dict[tuple[int, int], list[Slot]] = {}
    for s in layout:
        n = s.shape[0]
        m = s.numel // n
        r = min(n, m, rank)
        if (n + m) * r * min_rate < n * m:  # powerSGD_hook's rule: worth compressing
            groups.setdefault((n, m), []).append(s)
    start = 0
    for (n, m), slots in groups.items():
        r = min(n, m, rank)
        for s in slots:
            yield s, start, m * r, n * r
            start += m * r


def rng_record(rng: np.random.RandomState) -> dict[str, Any]:
    """numpy's generator state with its key as plain ints: a numpy array would need allowlisting in safe_load."""
    state = rng.get_state(legacy=False)
    return {**state, "state": {**state["state"], "key": state["state"]["key"].tolist()}}


def rng_from_record(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "state": {**record["state"], "key": np.asarray(record["state"]["key"], dtype=np.uint32)}}


class PowerSGD:
    """Registers PowerSGD on a DDP model; counts the bytes each step all-reduces; saves and loads its state."""

    def __init__(self, model: DistributedDataParallel, spec: DDPSpec, seed: int) -> None:
        self.index = {id(p): i for i, p in enumerate(model.module.parameters())}
        # The same seed on every rank: the random Q factors must agree across replicas.
        self.state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=spec.power_sgd_rank,
            start_powerSGD_iter=spec.power_sgd_start_step,
            random_seed=seed,
        )
        self.layouts: dict[int, list[Slot]] = {}
        """Bucket index -> the layout the state held for that bucket follows."""
        self.pending = ParamState()
        """Loaded or collected state not yet laid out for a bucket."""
        self.bytes = 0
        model.register_comm_hook(self.state, self.hook)

    def take_bytes(self) -> int:
        """Bytes passed to all-reduce since the last call (one optimizer step)."""
        n, self.bytes = self.bytes, 0
        return n

    def hook(self, state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        plain = state.iter < state.start_powerSGD_iter
        if not plain:
            self._arrange(bucket)
        before = state.total_numel_after_compression
        fut = powerSGD_hook(state, bucket)
        # Compressed: the uncompressed gradients + the P and Q factors (what the hook counted, synchronously).
        elements = buffer.numel() if plain else state.total_numel_after_compression - before
        self.bytes += elements * buffer.element_size()
        return fut

    # -- layouts

    def _layout(self, bucket: dist.GradBucket) -> list[Slot]:
        base = bucket.buffer().storage_offset()
        return [
            Slot(self.index[id(p)], int(g.storage_offset()) - int(base), tuple(g.shape))
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
        ]

    def _arrange(self, bucket: dist.GradBucket) -> None:
        """Lay the state out for this bucket when it holds none, or other parameters than it did."""
        b, layout = bucket.index(), self._layout(bucket)
        if self.layouts.get(b) == layout:
            return
        if b in self.layouts:
            # DDP rebuilt its buckets. Bucket 0 is always reduced first, so no other bucket's future is
            # still running now: move every bucket's state to per-parameter form.
            if b != 0:
                raise RuntimeError(f"DDP changed gradient bucket {b} in the middle of a step; PowerSGD cannot follow")
            self._collect()
        self._place(b, layout, bucket.buffer())

    def _place(self, b: int, layout: list[Slot], buffer: torch.Tensor) -> None:
        st, pend = self.state, self.pending
        self.layouts[b] = layout
        if layout and all(s.param in pend.errors for s in layout):
            error = torch.zeros_like(buffer)
            for s in layout:
                error[s.offset : s.offset + s.numel] = pend.errors.pop(s.param).to(buffer)
            st.error_dict[b] = error
        slots = list(q_slots(layout, st.matrix_approximation_rank, st.min_compression_rate))
        if slots and all(s.param in pend.qs and pend.qs[s.param].numel() == q for s, _, q, _ in slots):
            st.q_memory_dict[b] = torch.cat([pend.qs.pop(s.param).to(buffer) for s, _, _, _ in slots])
            # P is recomputed from Q before it is used; only its presence (warm start) matters.
            st.p_memory_dict[b] = buffer.new_zeros(sum(p for _, _, _, p in slots))

    def snapshot(self) -> ParamState:
        """The state of every laid-out bucket, per parameter (copies), with what is still pending."""
        st = self.state
        out = ParamState(dict(self.pending.errors), dict(self.pending.qs))
        for b, layout in self.layouts.items():
            if b in st.error_dict:
                error = st.error_dict[b]
                out.errors.update({s.param: error[s.offset : s.offset + s.numel].clone() for s in layout})
            if b in st.q_memory_dict:
                q = st.q_memory_dict[b]
                slots = q_slots(layout, st.matrix_approximation_rank, st.min_compression_rate)
                out.qs.update({s.param: q[start : start + n].clone() for s, start, n, _ in slots})
        return out

    def _collect(self) -> None:
        self.pending = self.snapshot()
        self.layouts.clear()
        for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            memory.clear()

    # -- checkpoints

    def save(self, path: Path) -> None:
        """Collective-free: every rank writes its own file (call it from every rank)."""
        st, held = self.state, self.snapshot()
        record: dict[str, Any] = {
            "world_size": dist.get_world_size(),
            "iter": st.iter,
            "rng": rng_record(st.rng),
            "numel_before": st.total_numel_before_compression,
            "numel_after": st.total_numel_after_compression,
            "next_stats_report": st.next_stats_report,
            "errors": {i: t.cpu() for i, t in held.errors.items()},
            "qs": {i: t.cpu() for i, t in held.qs.items()},
        }
        (path / STATE_DIR).mkdir(exist_ok=True)
        torch.save(record, path / STATE_DIR / f"rank-{dist.get_rank():05d}.pt")

    def load(self, path: Path) -> None:
        """This rank's file; at another world size, rank 0's without its error feedback (each rank's own)."""
        own = path / STATE_DIR / f"rank-{dist.get_rank():05d}.pt"
        first = path / STATE_DIR / f"rank-{0:05d}.pt"
        file = own if own.is_file() else first
        if not file.is_file():
            log.warning("checkpoint %s holds no PowerSGD state: compression starts afresh", path)
            return
        record = safe_load(file)
        same = record["world_size"] == dist.get_world_size() and file == own
        st = self.state
        st.iter = record["iter"]
        st.rng.set_state(rng_from_record(record["rng"]))
        st.total_numel_before_compression = record["numel_before"]
        st.total_numel_after_compression = record["numel_after"]
        st.next_stats_report = record["next_stats_report"]
        self.layouts.clear()
        for memory in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
            memory.clear()
        self.pending = ParamState(record["errors"] if same else {}, record["qs"])
        if not same:
            log.info("PowerSGD: world size changed; error feedback starts from zero")


def ddp_options(spec: DDPSpec | None, model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    """Extra DistributedDataParallel arguments. PowerSGD on gloo needs all gradients in one bucket:
    its hook waits for an all-reduce inside a future callback, which runs on one of gloo's two worker
    threads, so two buckets in flight can block both threads and hang the step."""
    if spec is None or spec.gradient_compression != "powersgd" or device.type != "cpu":
        return {}
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"bucket_cap_mb": grad_bytes // 2**20 + 1}


def attach(model: DistributedDataParallel, spec: DDPSpec | None, seed: int) -> PowerSGD | None:
    """The PowerSGD hook on ``model`` when the spec asks for it (never with fp16: api.SPEC_RULES refuses that)."""
    if spec is None or spec.gradient_compression != "powersgd":
        return None
    return PowerSGD(model, spec, seed)
