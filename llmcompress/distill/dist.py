"""torch.distributed glue: who am I, wait for the others, gather results on rank 0.

`torchrun --nproc-per-node N -m llmcompress distill ...` sets WORLD_SIZE/RANK; `from_env()` then joins
the group (gloo on CPU, nccl on GPU). Phase-1 segment training is independent per segment (each trains
on the teacher's cached inputs), so ranks split the segments and rank 0 assembles the student: the
result equals a single-process run up to floating-point reduction order.

The feature cache is built by rank 0; other ranks reuse it when they share its filesystem (one
machine) and otherwise build their own copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass
class DistInfo:
    """This process's place in the group (world 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` as a list on rank 0 (None elsewhere); [obj] when not distributed."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def from_env(device_type: str = "cpu") -> DistInfo:
    """Join the process group torchrun describes in the environment (no-op when WORLD_SIZE is 1 or unset)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), backend)


def shutdown(info: DistInfo) -> None:
    if info.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
