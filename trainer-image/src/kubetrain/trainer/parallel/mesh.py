"""The gang as a (dp, tp) grid: which data-parallel replica a rank serves, and the DeviceMesh over it.

Ranks fill the grid row by row (``rank = dp_rank × T + tp_rank``), so the T ranks of one tensor-parallel
group are consecutive. A worker's processes are consecutive ranks too (``NODE_RANK × procsPerWorker +
LOCAL_RANK``) and T divides procsPerWorker: every tensor-parallel group stays inside one worker, on its
fast intra-node links, while data parallelism crosses workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kubetrain.trainer.config import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DP = "dp"
"""The data-parallel dimension: ranks holding different batches (FSDP2 shards over it)."""
TP = "tp"
"""The tensor-parallel dimension: ranks holding different parts of the same layers, and the same batch."""


@dataclass(frozen=True)
class Layout:
    """The grid's shape from the world size and the tensor-parallel degree (pure)."""

    world_size: int
    tensor: int = 1

    def __post_init__(self) -> None:
        if self.tensor < 1 or self.world_size % self.tensor:
            raise ConfigError("parallelism.tensor", f"{self.tensor} does not divide the world size {self.world_size}")

    @property
    def data(self) -> int:
        """Data-parallel replicas: each draws its own share of the global batch."""
        return self.world_size // self.tensor

    def data_rank(self, rank: int) -> int:
        """The replica ``rank`` serves: the data it reads (its tensor-parallel peers read the same)."""
        return rank // self.tensor

    def tensor_rank(self, rank: int) -> int:
        return rank % self.tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape: one dimension (dp) without tensor parallelism, else (dp, tp)."""
        return (self.data,) if self.tensor == 1 else (self.data, self.tensor)

    @property
    def names(self) -> tuple[str, ...]:
        return (DP,) if self.tensor == 1 else (DP, TP)


def build_mesh(device_type: str, layout: Layout) -> DeviceMesh:
    """Collective: the gang's DeviceMesh on ``device_type``. Always explicit: without one, FSDP2 may pick CUDA
    where one exists while the gang runs on CPU."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    return init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.names)


def copies(t: torch.Tensor) -> int:
    """How many ranks hold each element of ``t`` (a parameter or its local shard's DTensor): a DTensor is
    split over its mesh's sharded dimensions and copied over the rest of the world; a plain tensor is
    taken as this rank's own (1)."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return 1
    shards = 1
    for dim, placement in enumerate(t.placements):  # type: ignore[attr-defined]
        if not placement.is_replicate():  # Shard, and FSDP2's _StridedShard over tensor-parallel shards
            shards *= mesh.size(dim)
    return dist.get_world_size() // shards
