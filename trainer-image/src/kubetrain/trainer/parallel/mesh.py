"""The gang as a (pp, replicate, dp, tp) grid: which stage and data-parallel replica a rank serves, and the mesh.

Ranks fill the grid row by row (``rank = (pp_rank × D + dp_rank) × T + tp_rank``), so the T ranks of one
tensor-parallel group are consecutive. Under HSDP (parallelism.replicate R > 1) the D data-parallel ranks of a
stage form R groups of D / R consecutive ones: FSDP2 shards within a group (the ``dp`` dimension) and
replicates across groups (``replicate``); the data rank is the same either way. A worker's processes are consecutive ranks too (``NODE_RANK ×
procsPerWorker + LOCAL_RANK``) and T divides procsPerWorker: every tensor-parallel group stays inside one
worker, on its fast intra-node links, while data parallelism and pipeline stages (the outermost dimension,
whose point-to-point activations are the least traffic) cross workers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kubetrain.core.api import ParallelismSpec
from kubetrain.trainer.config import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger("kubetrain.trainer")

DP = "dp"
"""The data-parallel dimension: ranks holding different batches (FSDP2 shards over it)."""
PP = "pp"
"""The pipeline dimension: ranks holding different blocks of the model, passing activations along."""
TP = "tp"
"""The tensor-parallel dimension: ranks holding different parts of the same layers, and the same batch."""
REPLICATE = "replicate"
"""HSDP's outer data-parallel dimension: groups holding the same shards (gradients all-reduced across them)."""


@dataclass(frozen=True)
class Layout:
    """The grid's shape from the world size and the tensor- and pipeline-parallel degrees (pure)."""

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    replicate: int = 1

    def __post_init__(self) -> None:
        if self.tensor < 1 or self.world_size % self.tensor:
            raise ConfigError("parallelism.tensor", f"{self.tensor} does not divide the world size {self.world_size}")
        if self.pipeline < 1 or self.world_size % (self.tensor * self.pipeline):
            raise ConfigError("parallelism.pipeline", f"tensor × pipeline ({self.tensor} × {self.pipeline}) does not "
                              f"divide the world size {self.world_size}")
        if self.replicate < 1 or self.data % self.replicate:
            raise ConfigError("parallelism.replicate", f"{self.replicate} does not divide the data-parallel ranks "
                              f"{self.data} (world size {self.world_size} / (tensor {self.tensor} × pipeline "
                              f"{self.pipeline}))")

    @classmethod
    def of(cls, world_size: int, parallelism: ParallelismSpec) -> Layout:
        return cls(world_size, parallelism.tensor, parallelism.pipeline, parallelism.replicate)

    @property
    def data(self) -> int:
        """Data-parallel replicas: each draws its own share of the global batch."""
        return self.world_size // (self.tensor * self.pipeline)

    def data_rank(self, rank: int) -> int:
        """The replica ``rank`` serves: the data it reads (its tensor-parallel and pipeline peers read the same)."""
        return rank // self.tensor % self.data

    def tensor_rank(self, rank: int) -> int:
        return rank % self.tensor

    def pipeline_rank(self, rank: int) -> int:
        """The pipeline stage ``rank`` runs (0 reads the tokens, the last computes the loss)."""
        return rank // (self.tensor * self.data)

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape: dp always, pp before it and tp after it only when their degree is above 1."""
        return tuple(size for size, _ in self._dims())

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for _, name in self._dims())

    @property
    def shard(self) -> int:
        """The ranks one FSDP2 group shards each parameter over (all data-parallel ranks without HSDP)."""
        return self.data // self.replicate

    def _dims(self) -> list[tuple[int, str]]:
        dims = [(self.pipeline, PP), (self.replicate, REPLICATE), (self.shard, DP), (self.tensor, TP)]
        return [(size, name) for size, name in dims if size > 1 or name == DP]


def build_mesh(device_type: str, layout: Layout) -> DeviceMesh:
    """Collective: the gang's DeviceMesh on ``device_type``. Always explicit: without one, FSDP2 may pick CUDA
    where one exists while the gang runs on CPU."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    if dist.get_rank() == 0:
        log.info("device mesh: %s", " x ".join(f"{name} {size}" for name, size in zip(layout.names, layout.shape,
                                                                                        strict=True)))
    return init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.names)


def data_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """What FSDP2 shards over: the ``dp`` dimension, or (``replicate``, ``dp``) for HSDP."""
    return mesh[(REPLICATE, DP)] if layout.replicate > 1 else mesh[DP]


def copies(t: torch.Tensor, pipeline: int = 1) -> int:
    """How many ranks hold each element of ``t`` (a parameter or its local shard's DTensor): a DTensor is
    split over its mesh's sharded dimensions and copied over the rest of its stage's ranks (the world, or
    one of its ``pipeline`` stages: the other stages hold other parameters); a plain tensor is taken as
    this rank's own (1)."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return 1
    shards = 1
    for dim, placement in enumerate(t.placements):  # type: ignore[attr-defined]
        if not placement.is_replicate():  # Shard, and FSDP2's _StridedShard over tensor-parallel shards
            shards *= mesh.size(dim)
    return dist.get_world_size() // pipeline // shards
