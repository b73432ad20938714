"""llmcompress.dist: joining torchrun's group. On a GPU machine each process takes its own GPU (LOCAL_RANK):
without it every rank of `torchrun --nproc-per-node 8` would allocate on GPU 0 and nccl would refuse or crawl."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmcompress import dist as D


def test_from_env_puts_each_cuda_rank_on_its_local_gpu(monkeypatch):
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("device", i)))
    monkeypatch.setattr(dist, "is_initialized", lambda: any(c[0] == "join" for c in calls))
    monkeypatch.setattr(dist, "init_process_group", lambda backend: calls.append(("join", backend)))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    info = D.from_env("cuda")
    assert calls == [("device", 3), ("join", "nccl")]  # the device is set before the group is joined (nccl binds to it)
    assert (info.rank, info.world_size, info.backend, info.is_main) == (3, 4, "nccl", False)
    calls.clear()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # each process sees only its own GPU
    D.from_env("cuda")
    assert calls == [("device", 0), ("join", "nccl")]
    calls.clear()
    assert D.from_env("cpu").backend == "gloo" and calls == [("join", "gloo")]


def test_from_env_outside_torchrun_joins_nothing(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: (_ for _ in ()).throw(AssertionError("joined")))
    info = D.from_env("cuda")
    assert not info.active and info.is_main
    D.leave(info)  # a no-op for one process
