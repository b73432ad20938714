"""torch.distributed glue shared by the engines: who am I, wait for the others, gather results on rank 0.

`torchrun --nproc-per-node N -m llmcompress <command> ...` sets WORLD_SIZE/RANK/LOCAL_RANK; `from_env()` then
joins the group (gloo on CPU, nccl on GPU, each process on its own GPU: `cuda:LOCAL_RANK`). Single process
stays the default; nothing needs torchrun on one machine. Who uses it:

* distill: phase-1 segment training is independent per segment (each trains on the teacher's cached
  inputs), so ranks split the segments and rank 0 assembles the student; `--mode e2e` and `--e2e-steps` run
  data-parallel DDP. The feature cache is built by rank 0; other ranks reuse it when they share its
  filesystem (one machine) and otherwise build their own copy.
* collapse (collapse/parallel.py): each rank scores a slice of every batch of candidates.
* GPTQ (quant/gptq.py): each rank quantizes a share of every layer's linears; the integers are exchanged.
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


def world() -> DistInfo:
    """This process's rank and the world size (world 1 when torch.distributed is not initialized)."""
    import sys

    if "torch.distributed" not in sys.modules:
        return DistInfo()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo()
    return DistInfo(dist.get_rank(), dist.get_world_size(), dist.get_backend())


def is_main() -> bool:
    return world().is_main


def from_env(device_type: str = "cpu") -> DistInfo:
    """Join the process group torchrun describes in the environment (no-op when WORLD_SIZE is 1 or unset)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return DistInfo()
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":  # one GPU per process: `cuda` (and `auto`) then mean this rank's own device
        import torch

        # modulo: where each process sees only its own GPU (CUDA_VISIBLE_DEVICES per rank), LOCAL_RANK is past the count
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), backend)


def shutdown(info: DistInfo) -> None:
    """Wait for every rank, then leave the group."""
    if info.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
    leave(info)


def leave(info: DistInfo) -> None:
    """Leave the group without waiting for the others: for a rank whose last collective step is done while
    rank 0 goes on alone (writing the result), so an error there never leaves the others at a barrier."""
    if info.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
