"""Worker used by tests/test_comm.py and bench/bench_zip.py: compressed vs plain collectives on gloo."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def worker(rank: int, world: int, port: int, out_dir: str, ddp_steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LLMCOMPRESS_PROGRESS="0")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from llmcompress.comm import collectives as C

    res: dict = {"rank": rank, "checks": {}}
    g = torch.Generator().manual_seed(1234 + rank)
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if world == 2 else (torch.bfloat16, torch.float32)
    for dt in dtypes:
        for n in (0, 5, 20_003):
            x = (torch.randn(n, generator=g) * 0.02).to(dt)
            if n > 10:
                x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")]).to(dt)
            key = f"{dt}-{n}"
            ag_c = C.all_gather(x, compress=True)
            ag_p = C.all_gather(x, compress=False)
            ok = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ag_c, ag_p))
            rs_c = C.reduce_scatter(x, compress=True)
            rs_p = C.reduce_scatter(x, compress=False)
            ok &= torch.equal(_bits(rs_c), _bits(rs_p))
            ar_c = C.all_reduce(x, compress=True)
            ar_p = C.all_reduce(x, compress=False)
            ok &= torch.equal(_bits(ar_c), _bits(ar_p))
            # every rank holds the same bits
            same = C.all_gather(ar_c, compress=False)
            ok &= all(torch.equal(_bits(s), _bits(ar_c)) for s in same)
            if dt == torch.float32 and world == 2 and n > 10:  # equals the backend's own sum
                ref = x.clone()
                dist.all_reduce(ref)
                ok &= torch.equal(_bits(ref), _bits(ar_c))
            res["checks"][key] = bool(ok)
    if ddp_steps:
        res["ddp"] = _ddp(rank, world, ddp_steps)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def _ddp(rank: int, world: int, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from llmcompress.comm.collectives import Strategy, zipccl_hook

    def train(hook_state) -> tuple[torch.Tensor, list]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
        ddp = DDP(model, bucket_cap_mb=1)
        if hook_state is not None:
            ddp.register_comm_hook(hook_state, zipccl_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            x = torch.randn(32, 256, generator=g)
            loss = ddp(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return flat, (hook_state.decisions if hook_state is not None else [])

    base, _ = train(None)  # DDP's default all-reduce hook
    comp, dec_c = train(Strategy(force="compressed", min_bytes=0))
    plain, _ = train(Strategy(force="plain"))
    auto, dec_a = train(Strategy(min_bytes=0))
    return {
        "compressed_equals_plain": bool(torch.equal(_bits(comp), _bits(plain))),
        "auto_equals_plain": bool(torch.equal(_bits(auto), _bits(plain))),
        "compressed_equals_ddp_default": bool(torch.equal(_bits(comp), _bits(base))),
        "auto_decisions": dec_a[:4],
        "compressed_buckets": sum(1 for d in dec_c if d["compressed"]),
    }


def run(world: int, out_dir: str, ddp_steps: int = 0) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, out_dir, ddp_steps), nprocs=world, join=True)
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
