"""Where one worker sits in a replica spread over devices: its rank, the world, its device and process groups.

The engine core never sees a device; an executor (a parallel-strategy plugin's, or the uniprocess one)
makes one `ParallelContext` per worker and the worker hands it to model construction and weight loading,
so that a tensor-parallel linear knows which shard it holds and where it lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_CPU = torch.device("cpu")

@dataclass(frozen=True, slots=True)
class ParallelContext:
    """One rank of a replica. Process groups are `torch.distributed` groups, or None where the strategy has none
    (a single device, or a strategy that does not split that dimension)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # the device index on this host
    device: torch.device = _CPU
    tensor_group: Any | None = None  # ranks that split each layer (tensor parallelism)
    expert_group: Any | None = None  # ranks that split the experts (expert parallelism)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        if not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", torch.device(self.device))

    @property
    def is_driver(self) -> bool:
        """Rank 0: the worker whose outputs (logits, hidden states) the engine core reads."""
        return self.rank == 0

    @classmethod
    def single(cls, device: torch.device | str) -> ParallelContext:
        """The context of a replica on one device (no process groups)."""
        return cls(device=torch.device(device))


def device_for(is_cuda: bool, local_rank: int = 0) -> torch.device:
    """The device of the worker at `local_rank` on this host, from what the hardware probe found."""
    return torch.device("cuda", local_rank) if is_cuda else torch.device("cpu")
