"""llmcompress.dist: joining torchrun's group. On a GPU machine each process takes its own GPU (LOCAL_RANK):
without it every rank of `torchrun --nproc-per-node 8` would allocate on GPU 0 and nccl would refuse or crawl."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmcompress import dist as D


def test_from_env_puts_each_cuda_rank_on_its_local_gpu(monkeypatch):
    chosen, joined = [], []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: chosen.append(i))
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(joined))
    monkeypatch.setattr(dist, "init_process_group", lambda backend: joined.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    info = D.from_env("cuda")
    assert chosen == [3] and joined == ["nccl"]  # the device is set before the group is joined (nccl binds to it)
    assert (info.rank, info.world_size, info.backend, info.is_main) == (3, 4, "nccl", False)
    chosen.clear()
    joined.clear()
    assert D.from_env("cpu").backend == "gloo" and chosen == [] and joined == ["gloo"]


def test_from_env_outside_torchrun_joins_nothing(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: (_ for _ in ()).throw(AssertionError("joined")))
    info = D.from_env("cuda")
    assert not info.active and info.is_main
    D.leave(info)  # a no-op for one process
