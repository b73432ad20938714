"""EDGC vs plain all-reduce, lossless ZipCCL and fixed-rank PowerSGD: 2 gloo processes training a reduced LLaMA.

Every arm trains the same model from the same seed on the same shards (WikiText-2 valid split for training, test split for perplexity; SmolLM2 tokenizer,
vocabulary cut to the `--vocab` most frequent training tokens plus one UNK id: a reduced LLaMA config) for
`--steps` steps, 2 processes with torch.set_num_threads(1) each, DDP on gloo over loopback. The currency is
bytes (counted exactly by llmcompress.comm.edgc) and measured compute: loopback is too fast for wall-clock
gains to show.

    python bench/bench_edgc.py [--steps 300] [--arms none,zip,psgd2,...,edgc]

Writes bench/RESULTS-edgc.{json,md} and bench/RESULTS-edgc-trace.png (EDGC's rank and entropy over the steps).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ARMS = ["none", "zip", "psgd2", "psgd4", "psgd8", "psgd16", "psgd32", "edgc"]
MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, tie_word_embeddings=True)
EDGC = dict(r_min=2, r_max=32, window=10, sample_every=2, sample_fraction=0.02, max_step=4)


def prepare(vocab: int, work: Path) -> Path:
    """Token ids of WikiText-2 train/test in the reduced vocabulary, saved once for the workers."""
    path = work / f"data-v{vocab}.pt"
    if path.is_file():
        return path
    from llmcompress.data.blocks import token_stream
    from llmcompress.data.sources import load_texts
    from llmcompress.io.load import load_model

    tok = load_model("smollm2-135m").tokenizer
    train = token_stream(tok, load_texts("wikitext2", "valid"))
    test = token_stream(tok, load_texts("wikitext2", "test"))
    counts = torch.bincount(train, minlength=len(tok))
    keep = counts.argsort(descending=True)[: vocab - 1]
    remap = torch.full((len(tok),), vocab - 1, dtype=torch.long)
    remap[keep] = torch.arange(vocab - 1)
    torch.save({"train": remap[train], "test": remap[test], "unk_share": float((remap[train] == vocab - 1).float().mean())}, path)
    return path


def worker(rank: int, world: int, port: int, arm: str, args: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LLMCOMPRESS_PROGRESS="0")
    torch.set_num_threads(1)
    import torch.distributed as dist
    import transformers
    from torch.nn.parallel import DistributedDataParallel as DDP

    from llmcompress.comm.edgc import GradCompression

    dist.init_process_group("gloo", rank=rank, world_size=world)
    data = torch.load(args["data"])
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=args["vocab"], **MODEL)
    model = transformers.LlamaForCausalLM(cfg)
    scheme = "powersgd" if arm.startswith("psgd") else arm
    comp = GradCompression(scheme, model, rank=int(arm[4:]) if arm.startswith("psgd") else 8, start_iter=args["start"],
                           entropy_span=args["span"], **EDGC)
    ddp = DDP(model)
    comp.register(ddp, timed=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args["lr"], weight_decay=0.0)
    T, B, steps = args["seq"], args["batch"], args["steps"]
    blocks = data["train"][: (len(data["train"]) // T) * T].view(-1, T)
    per = B // world
    recs = []
    for step in range(steps):
        warm = 20
        lr = args["lr"] * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids = blocks[step * B + rank * per : step * B + (rank + 1) * per]  # this rank's shard of the global batch
        t0 = time.perf_counter()
        h0, m0 = comp.hook_s, comp.psgd.monitor_s if comp.psgd else 0.0
        loss = ddp(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        rec = comp.end_step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step_s = time.perf_counter() - t0
        lv = loss.detach().clone()
        dist.all_reduce(lv)
        rec.update(step=step, loss=float(lv) / world, step_s=step_s, hook_s=comp.hook_s - h0,
                   monitor_s=(comp.psgd.monitor_s - m0) if comp.psgd else 0.0)
        recs.append(rec)
    ppl = None
    if rank == 0:
        model.eval()
        test = data["test"][: (min(len(data["test"]), args["eval_tokens"]) // T) * T].view(-1, T)
        with torch.no_grad():
            nll = [model(input_ids=test[i : i + 8], labels=test[i : i + 8], use_cache=False).loss.item() for i in range(0, len(test), 8)]
        ppl = math.exp(sum(nll) / len(nll))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        res = {"arm": arm, "recs": recs, "summary": comp.summary(), "ppl": ppl, "params": sum(p.numel() for p in model.parameters()),
               "matrix_params": sum(p.numel() for p in model.parameters() if id(p) in comp.matrix_ids),
               "weights_sha": __import__("hashlib").sha256(flat.numpy().tobytes()).hexdigest()[:16]}
        if comp.psgd is not None:
            res["rank_trace"], res["entropy_trace"] = comp.psgd.rank_trace, comp.psgd.entropy_trace
        Path(out, f"{arm}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def run_arm(arm: str, args: dict, out: Path) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    mp.spawn(worker, args=(2, port, arm, args, str(out)), nprocs=2, join=True)
    res = json.loads((out / f"{arm}.json").read_text())
    res["wall_s"] = time.perf_counter() - t0
    return res


def final_loss(recs: list[dict]) -> float:
    n = max(1, len(recs) // 10)
    return sum(r["loss"] for r in recs[-n:]) / n


def bytes_to_reach(recs: list[dict], target: float, key: str = "comm_bytes", k: int = 10) -> int | None:
    """Cumulative bytes at the first step whose mean loss over the last k steps is <= target."""
    cum = 0
    for i, r in enumerate(recs):
        cum += r[key]
        if i + 1 >= k and sum(x["loss"] for x in recs[i + 1 - k : i + 1]) / k <= target:
            return cum
    return None


def analyse(results: dict[str, dict], args: dict) -> dict:
    plain = results["none"]
    f_plain = final_loss(plain["recs"])
    target = f_plain * 1.01
    n = len(plain["recs"])
    lo_bw = sum(r["comm_bytes"] for r in plain["recs"]) / max(1e-9, sum(r["hook_s"] for r in plain["recs"]))  # loopback B/s
    rows = {}
    for arm in [x for x in ARMS if x in results]:
        res = results[arm]
        recs = res["recs"]
        tot = sum(r["comm_bytes"] for r in recs)
        mat = sum(r["comm_matrix_bytes"] for r in recs)
        hook = sum(r["hook_s"] for r in recs) / n
        compute = max(0.0, hook - tot / n / lo_bw)  # time in the hook that is not moving bytes over loopback
        compute_plain = max(0.0, sum(r["hook_s"] for r in plain["recs"]) / n - sum(r["comm_bytes"] for r in plain["recs"]) / n / lo_bw)
        saved = (sum(r["comm_bytes"] for r in plain["recs"]) - tot) / n
        extra = compute - compute_plain
        be = (saved / extra / 1e6) if extra > 0 and saved > 0 else (float("inf") if saved > 0 else None)
        step_s = sum(r["step_s"] for r in recs)
        rows[arm] = {
            "final_loss": final_loss(recs), "ppl": res["ppl"], "bytes_total": tot, "bytes_matrices": mat,
            "bytes_to_target": bytes_to_reach(recs, target), "matrix_bytes_to_target": bytes_to_reach(recs, target, "comm_matrix_bytes"),
            "hook_s_per_step": hook, "compute_s_per_step": compute, "break_even_MBps": be,
            "monitor_share": sum(r["monitor_s"] for r in recs) / step_s if step_s else 0.0,
            "step_s": step_s / n, "weights_sha": res["weights_sha"], "final_rank": res["summary"].get("final_rank"),
            "rank_changes": len(res["summary"].get("rank_changes", [])), "wall_s": res["wall_s"],
        }
    return {"target_loss": target, "plain_final_loss": f_plain, "loopback_MBps": lo_bw / 1e6, "rows": rows}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.8))
    for arm, res in results.items():
        cum, xs, ys = 0, [], []
        for r in res["recs"]:
            cum += r["comm_matrix_bytes"]
            xs.append(cum / 1e6)
        k = 10
        ys = [sum(x["loss"] for x in res["recs"][max(0, i - k + 1) : i + 1]) / min(k, i + 1) for i in range(len(res["recs"]))]
        a.plot(xs, ys, label=arm, lw=1)
    a.set_xscale("log")
    a.set_xlabel("cumulative bytes sent per rank, matrices (MB, log)")
    a.set_ylabel("training loss (10-step mean)")
    a.legend(fontsize=7)
    e = results.get("edgc")
    if e:
        rt, et = e["rank_trace"], e["entropy_trace"]
        xs = [i for i, r in enumerate(rt) if r is not None]
        b.step(xs, [rt[i] for i in xs], where="post", color="tab:blue")
        b.set_xlabel("step")
        b.set_ylabel("EDGC rank", color="tab:blue")
        b2 = b.twinx()
        es = [(i, h) for i, h in enumerate(et) if h is not None]
        b2.plot([i for i, _ in es], [h for _, h in es], ".", ms=3, color="tab:orange")
        b2.set_ylabel("reduced-gradient entropy (bits)", color="tab:orange")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt_bytes(b) -> str:
    return "not reached" if b is None else f"{b / 1e6:,.2f} MB"


def report(an: dict, args: dict, results: dict) -> str:
    rows = an["rows"]
    lines = ["# EDGC benchmark", "", f"`python bench/bench_edgc.py --steps {args['steps']}`, {_dt.date.today()}, 2 gloo processes "
             f"(torch.set_num_threads(1) each) on 2 shared CPU cores; reduced LLaMA {MODEL} with vocab {args['vocab']} "
             f"({results['none']['params']:,} parameters, {results['none']['matrix_params']:,} in decoder matrices); trained on WikiText-2 valid, perplexity on test, "
             f"global batch {args['batch']} x {args['seq']} tokens, AdamW lr {args['lr']}, dense warm-up {args['start']} steps for PowerSGD/EDGC.",
             "", f"Target loss = plain all-reduce's final loss x 1.01 = {an['target_loss']:.4f}. Loopback all-reduce measured at "
             f"{an['loopback_MBps']:.0f} MB/s (used to split hook time into transfer and compute).", "",
             "| arm | final loss | WikiText-2 ppl | bytes, matrices | bytes, whole model | matrix bytes to target | bytes to target | compute/step (ms) | break-even link (MB/s) | monitor share | final rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in rows.items():
        be = r["break_even_MBps"]
        bes = "-" if be is None else ("any" if be == float("inf") else f"{be:,.0f}")
        lines.append(f"| {arm} | {r['final_loss']:.4f} | {r['ppl']:.1f} | {fmt_bytes(r['bytes_matrices'])} | {fmt_bytes(r['bytes_total'])} | "
                     f"{fmt_bytes(r['matrix_bytes_to_target'])} | {fmt_bytes(r['bytes_to_target'])} | {1e3 * r['compute_s_per_step']:.1f} | {bes} | "
                     f"{100 * r['monitor_share']:.2f}% | {r['final_rank'] if r['final_rank'] is not None else '-'} |")
    return "\n".join(lines) + "\n"


def goals(an: dict) -> list[str]:
    rows = an["rows"]
    out = []
    if "edgc" in rows:
        e, p = rows["edgc"], rows["none"]
        out.append(f"EDGC final loss within 1% of plain: {e['final_loss']:.4f} vs {p['final_loss']:.4f} "
                   f"({100 * (e['final_loss'] / p['final_loss'] - 1):+.2f}%) -> {'met' if e['final_loss'] <= p['final_loss'] * 1.01 else 'missed'}")
        ratio = p["bytes_matrices"] / e["bytes_matrices"]
        out.append(f"EDGC matrix bytes >= 10x below plain: {ratio:.1f}x -> {'met' if ratio >= 10 else 'missed'}")
        reach = {a: r for a, r in rows.items() if a.startswith("psgd") and r["final_loss"] <= an["target_loss"]}
        if reach:
            cheapest = min(reach, key=lambda a: reach[a]["bytes_matrices"])
            cut = 1 - e["bytes_matrices"] / reach[cheapest]["bytes_matrices"]
            out.append(f"EDGC matrix bytes >= 30% below the cheapest fixed-rank PowerSGD reaching the target ({cheapest}): {100 * cut:.0f}% -> "
                       f"{'met' if cut >= 0.3 else 'missed'}")
        else:
            out.append("no fixed-rank PowerSGD arm reached the target loss (within 1% of plain)")
        out.append(f"monitoring overhead <= 3% of step time: {100 * e['monitor_share']:.2f}% -> {'met' if e['monitor_share'] <= 0.03 else 'missed'}")
    if "zip" in rows:
        same = rows["zip"]["weights_sha"] == rows["none"]["weights_sha"]
        out.append(f"zip bit-identical to plain (final weights sha256): {'met' if same else 'missed'}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--start", type=int, default=30)
    ap.add_argument("--span", type=float, default=0.2)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--work", default="/tmp/bench_edgc")
    ap.add_argument("--reuse", action="store_true", help="report the other arms from their stored results in --work")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    args = {"steps": a.steps, "vocab": a.vocab, "seq": a.seq, "batch": a.batch, "lr": a.lr, "start": a.start, "span": a.span,
            "eval_tokens": a.eval_tokens, "data": str(prepare(a.vocab, work))}
    results = {}
    if a.reuse:  # arms not in --arms: their stored results from an earlier run in --work with the same settings
        for arm in ARMS:
            f = work / f"{arm}.json"
            if arm not in a.arms.split(",") and f.is_file():
                results[arm] = json.loads(f.read_text())
                results[arm].setdefault("wall_s", None)
    for arm in a.arms.split(","):
        results[arm] = run_arm(arm, args, work)
        r = results[arm]
        print(f"{arm}: final loss {final_loss(r['recs']):.4f} ppl {r['ppl']:.1f} bytes {sum(x['comm_bytes'] for x in r['recs']) / 1e6:.1f} MB "
              f"wall {r['wall_s']:.0f}s", flush=True)
    out = Path(a.out)
    if "none" not in results:
        return
    an = analyse(results, args)
    an["goals"] = goals(an)
    an["args"] = args
    md = report(an, args, results) + "\nGoals:\n\n" + "\n".join(f"- {g}" for g in an["goals"]) + "\n"
    (out / "RESULTS-edgc.md").write_text(md)
    (out / "RESULTS-edgc.json").write_text(json.dumps({"analysis": an, "traces": {k: {"loss": [r["loss"] for r in v["recs"]],
        "rank": v.get("rank_trace"), "entropy": v.get("entropy_trace")} for k, v in results.items()}}, indent=1))  # fmt: skip
    plot(results, out / "RESULTS-edgc-trace.png")
    print(md)


if __name__ == "__main__":
    sys.exit(main())
