"""Workers for tests/test_edgc.py: DDP with the gradient-compression hooks on gloo, on a small MLP.

Each rank trains on its own random data (rank r's inputs are scaled by 1 + 4r, so local gradients differ a
lot); every rank writes OUT/rank{r}.pt.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 80), torch.nn.GELU(), torch.nn.Linear(80, 8))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 64, generator=g) * (1.0 + 4.0 * rank)
    y = torch.randn(16, 8, generator=g)
    return x, y


def train(scheme: str, steps: int, *, rank: int, world: int, force: dict | None = None, stop_at: int | None = None,
          resume: dict | None = None, **kw) -> dict:
    """Train steps [0 or the checkpoint's step, stop_at or steps); returns weights, records and a checkpoint."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from llmcompress.comm.edgc import GradCompression

    model = _model()
    comp = GradCompression(scheme, model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        comp.load_state_dict(resume["comp"][rank])
        start = resume["step"]
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets, rebuilt after the first iteration
    comp.register(ddp)
    out: dict = {"recs": [], "changes": {}, "grads": []}
    for step in range(start, steps if stop_at is None else stop_at):
        x, y = _batch(rank, step)
        loss = (ddp(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if step < 3:  # the reduced gradients DDP left in .grad (warm-up: plain all-reduce)
            out["grads"].append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        if force and step in force:  # a forced rank change: error feedback must survive it
            ps = comp.psgd
            before = {k: v.clone() for k, v in ps.error_dict.items()}
            old_r, old_q = ps.rank, {k: v.clone() for k, v in ps.q_memory_dict.items()}
            ps.force_rank(force[step])
            rec = comp.end_step()
            out["changes"][step] = {
                "error_kept": bool(before) and before.keys() == ps.error_dict.keys()
                and all(torch.equal(before[k], ps.error_dict[k]) for k in before),
                "pq_cleared": not ps.p_memory_dict and not ps.q_memory_dict,
                "rank": ps.rank,
            }
            if ps.carry_q:  # each matrix's new Q starts with its old Q's leading columns, sized for the new rank
                kept = []
                for idx, q in ps.q_memory_dict.items():
                    new_s, old_s = ps.pq_slices(ps.layout[idx]), ps.pq_slices(ps.layout[idx], old_r)
                    for name, (_, _, qo, qn) in new_s.items():
                        if name not in old_s:  # compressed at the new rank only: drawn at random
                            continue
                        m, k = math.prod(ps.shapes[name][1:]), min(ps.rank, old_r)
                        _, _, oqo, oqn = old_s[name]
                        kept.append(torch.equal(q[qo : qo + qn].view(m, -1)[:, :k], old_q[idx][oqo : oqo + oqn].view(m, -1)[:, :k]))
                out["changes"][step]["q_carried"] = bool(kept) and all(kept)
        else:
            rec = comp.end_step()
        out["recs"].append(rec)
        opt.step()
    out["flat"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["summary"] = comp.summary()
    if comp.psgd is not None:
        out["rank_trace"], out["entropy_trace"] = list(comp.psgd.rank_trace), list(comp.psgd.entropy_trace)
    if stop_at is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, comp.state_dict())
        out["checkpoint"] = {"model": model.state_dict(), "opt": opt.state_dict(), "comp": gathered, "step": stop_at}
    return out


def worker(rank: int, world: int, port: int, out_dir: str, case: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    kw = dict(rank=rank, world=world)
    edgc = dict(r_min=1, r_max=8, start_iter=3, window=3, sample_every=1, sample_fraction=0.5, entropy_span=0.02)
    res: dict = {}
    if "schemes" in case:
        for scheme in ("none", "zip"):
            res[scheme] = train(scheme, 6, **kw)
        res["powersgd"] = train("powersgd", 8, **kw)  # the default warm-up (2 steps), as EDGC's
        res["edgc"] = train("edgc", 3, **kw)
    if "force" in case:
        res["force"] = train("edgc", 12, force={5: 2, 8: 6}, **edgc, **kw)
        res["carry"] = train("edgc", 12, force={5: 2, 8: 6}, carry_q=True, **edgc, **kw)
    if "resume" in case:
        res["full"] = train("edgc", 20, **edgc, **kw)
        half = train("edgc", 20, stop_at=11, **edgc, **kw)
        res["resumed"] = train("edgc", 20, resume=half.pop("checkpoint"), **edgc, **kw)
        res["half"] = half
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, out_dir: str, case: str) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, out_dir, case), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
