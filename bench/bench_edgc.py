"""EDGC vs plain all-reduce, lossless ZipCCL and fixed-rank PowerSGD: 2 gloo processes training a reduced LLaMA.

Every arm trains the same model from the same seed on the same shards (WikiText-2 valid split for training, test split for perplexity; SmolLM2 tokenizer,
vocabulary cut to the `--vocab` most frequent training tokens plus one UNK id: a reduced LLaMA config) for
`--steps` steps, 2 processes with torch.set_num_threads(1) each, DDP on gloo over loopback. The currency is
bytes (counted exactly by llmcompress.comm.edgc) and measured compute: loopback is too fast for wall-clock
gains to show.

    python bench/bench_edgc.py [--steps 300] [--seeds 0,1,2] [--arms none,zip,psgd2,...,edgc] [--zip-steps 60]

`--seeds`: each seed draws its own initial weights, order of the training blocks and PowerSGD random vectors
(the same for every arm of that seed); goals are judged per seed. Every compressed arm (fixed-rank PowerSGD
and EDGC) sends plain all-reduces for the same `--start` (2) warm-up steps. Arm `edgcN` is EDGC with r_max N,
`edgcNsX` (or `edgcsX`) also with entropy span X instead of `--span`; a trailing `q` (`edgcq`, `edgc16q`) keeps
the warm-start Q across rank changes (`carry_q`) instead of re-drawing it.
`--zip-steps N` stops the (slow) lossless arm after N of the `--steps`-step schedule: its final weights are
compared with plain all-reduce's at the same step, its bytes per step with plain's over those steps.

Writes bench/RESULTS-edgc.{json,md} and bench/RESULTS-edgc-trace.png (EDGC's rank and entropy over the steps).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import socket
import sys
import time
from pathlib import Path

import torch

from llmcompress.runtime import cpu_model

HERE = Path(__file__).resolve().parent
ARMS = ["none", "zip", "psgd2", "psgd4", "psgd8", "psgd16", "psgd32", "edgc"]
MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, tie_word_embeddings=True)
EDGC = dict(r_min=2, r_max=32, window=10, sample_every=2, sample_fraction=0.02, max_step=4)


ARM_RE = re.compile(r"none|zip|psgd([1-9][0-9]*)|edgc([1-9][0-9]*)?(?:s([0-9]*\.?[0-9]+))?(q)?")


def arm_kwargs(arm: str, args: dict) -> tuple[str, dict]:
    """(scheme, GradCompression keyword arguments) of an arm: none, zip, psgdR (rank R), edgc, edgcN (r_max N),
    edgcNsX or edgcsX (entropy span X instead of --span), any EDGC arm + q (carry_q: Q kept across rank changes)."""
    m = ARM_RE.fullmatch(arm)
    if m is None:
        raise ValueError(f"unknown arm {arm!r}: none, zip, psgdR, edgc, edgcN, edgcNsX")
    if m[1]:
        return "powersgd", dict(rank=int(m[1]), start_iter=args["start"], seed=args["seed"])
    if arm.startswith("edgc"):
        kw = dict(EDGC, start_iter=args["start"], entropy_span=float(m[3]) if m[3] else args["span"], seed=args["seed"])
        if m[2]:
            kw["r_max"] = int(m[2])
        if m[4]:
            kw["carry_q"] = True
        return "edgc", kw
    return arm, {}


def weights_sha(model) -> str:
    import hashlib

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


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
    torch.manual_seed(args["seed"])
    cfg = transformers.LlamaConfig(vocab_size=args["vocab"], **MODEL)
    model = transformers.LlamaForCausalLM(cfg)
    scheme, kw = arm_kwargs(arm, args)
    comp = GradCompression(scheme, model, **kw)
    ddp = DDP(model)
    comp.register(ddp, timed=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args["lr"], weight_decay=0.0)
    T, B, steps = args["seq"], args["batch"], args["steps"]
    blocks = data["train"][: (len(data["train"]) // T) * T].view(-1, T)
    blocks = blocks[torch.randperm(len(blocks), generator=torch.Generator().manual_seed(args["seed"]))]  # the seed's order
    per = B // world
    stop = args["zip_steps"] if arm == "zip" else steps
    recs, sha_at = [], {}
    for step in range(stop):
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
        if rank == 0 and step + 1 == args["zip_steps"]:
            sha_at[str(step + 1)] = weights_sha(model)
    ppl = None
    if rank == 0:
        if stop == steps:
            model.eval()
            test = data["test"][: (min(len(data["test"]), args["eval_tokens"]) // T) * T].view(-1, T)
            with torch.no_grad():
                nll = [model(input_ids=test[i : i + 8], labels=test[i : i + 8], use_cache=False).loss.item() for i in range(0, len(test), 8)]
            ppl = math.exp(sum(nll) / len(nll))
        res = {"arm": arm, "seed": args["seed"], "recs": recs, "summary": comp.summary(), "ppl": ppl,
               "params": sum(p.numel() for p in model.parameters()),
               "matrix_params": sum(p.numel() for p in model.parameters() if id(p) in comp.matrix_ids),
               "weights_sha": weights_sha(model), "sha_at": sha_at}
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
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    mp.spawn(worker, args=(2, port, arm, args, str(out)), nprocs=2, join=True)
    res = json.loads((out / f"{arm}.json").read_text())
    res["wall_s"] = time.perf_counter() - t0
    res["load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]  # 1-minute load average before and after
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


def arm_order(arms) -> list[str]:
    extra = sorted((a for a in arms if a not in ARMS), key=lambda a: (not a.startswith("edgc"), a))
    return [a for a in ARMS if a in arms] + extra


def analyse(results: dict[str, dict], args: dict) -> dict:
    """One seed's table: loss, bytes (whole run and to the target loss), compute, break-even link, monitor share."""
    plain = results["none"]
    f_plain = final_loss(plain["recs"])
    target = f_plain * 1.01
    prec = plain["recs"]
    lo_bw = sum(r["comm_bytes"] for r in prec) / max(1e-9, sum(r["hook_s"] for r in prec))  # loopback B/s

    def per_step(recs, key):
        return sum(r[key] for r in recs) / len(recs)

    rows = {}
    for arm in arm_order(results):
        res = results[arm]
        recs = res["recs"]
        n = len(recs)
        full = n == len(prec)
        tot = sum(r["comm_bytes"] for r in recs)
        mat = sum(r["comm_matrix_bytes"] for r in recs)
        base = prec[:n]  # plain over the same steps (the zip arm may stop early)
        hook = per_step(recs, "hook_s")
        compute = max(0.0, hook - tot / n / lo_bw)  # time in the hook that is not moving bytes over loopback
        compute_plain = max(0.0, per_step(base, "hook_s") - per_step(base, "comm_bytes") / lo_bw)
        saved = per_step(base, "comm_bytes") - tot / n
        extra = compute - compute_plain
        be = (saved / extra / 1e6) if extra > 0 and saved > 0 else (float("inf") if saved > 0 else None)
        step_s = sum(r["step_s"] for r in recs)
        sha_ref = plain.get("sha_at", {}).get(str(n)) if not full else plain["weights_sha"]
        rows[arm] = {
            "steps": n, "final_loss": final_loss(recs) if full else None, "ppl": res["ppl"], "bytes_total": tot,
            "bytes_matrices": mat, "matrix_ratio": sum(r["comm_matrix_bytes"] for r in base) / mat if mat else None,
            "total_ratio": sum(r["comm_bytes"] for r in base) / tot if tot else None,
            "bytes_to_target": bytes_to_reach(recs, target) if full else None,
            "matrix_bytes_to_target": bytes_to_reach(recs, target, "comm_matrix_bytes") if full else None,
            "hook_s_per_step": hook, "compute_s_per_step": compute, "break_even_MBps": be,
            "monitor_s": sum(r["monitor_s"] for r in recs), "monitor_share": sum(r["monitor_s"] for r in recs) / step_s if step_s else 0.0,
            "step_s": step_s / n, "weights_sha": res["weights_sha"], "same_bits_as_plain": res["weights_sha"] == sha_ref,
            "final_rank": res["summary"].get("final_rank"), "mean_rank": mean_rank(res.get("rank_trace")),
            "rank_changes": len(res["summary"].get("rank_changes", [])), "wall_s": res.get("wall_s"), "load": res.get("load"),
        }
    return {"seed": args["seed"], "target_loss": target, "plain_final_loss": f_plain, "loopback_MBps": lo_bw / 1e6, "rows": rows}


def mean_rank(trace) -> float | None:
    xs = [r for r in trace or [] if r is not None]
    return sum(xs) / len(xs) if xs else None


def judge(an: dict, arm: str) -> dict:
    """The goals for one EDGC arm of one seed (numbers and met/missed)."""
    rows = an["rows"]
    e, p = rows[arm], rows["none"]
    out = {"seed": an["seed"], "arm": arm, "loss_delta": e["final_loss"] / p["final_loss"] - 1, "matrix_ratio": e["matrix_ratio"],
           "total_ratio": e["total_ratio"], "monitor_share": e["monitor_share"], "mean_rank": e["mean_rank"]}
    out["loss_met"] = e["final_loss"] <= an["target_loss"]
    out["ratio_met"] = e["matrix_ratio"] >= 10
    out["monitor_met"] = e["monitor_share"] <= 0.03
    fixed = {a: r for a, r in rows.items() if a.startswith("psgd")}
    out["fixed_ranks"] = sorted(int(a[4:]) for a in fixed)
    # the baseline a user would pick: the cheapest fixed rank whose final loss is within the same 1% of plain
    reach = {a: r for a, r in fixed.items() if r["final_loss"] <= an["target_loss"]}
    if reach:
        cheapest = min(reach, key=lambda a: reach[a]["bytes_matrices"])
        out["cheapest"] = cheapest
        out["cheapest_loss_delta"] = reach[cheapest]["final_loss"] / p["final_loss"] - 1
        out["cut"] = 1 - e["bytes_matrices"] / reach[cheapest]["bytes_matrices"]
        out["cut_met"] = out["cut"] >= 0.3 and out["loss_met"]
    else:
        out["cheapest"], out["cheapest_loss_delta"], out["cut"], out["cut_met"] = None, None, None, None
    if "zip" in rows:
        out["zip_identical"] = rows["zip"]["same_bits_as_plain"]
        out["zip_steps"] = rows["zip"]["steps"]
    return out


def fmt_bytes(b) -> str:
    return "not reached" if b is None else f"{b / 1e6:,.2f} MB"


def fewer(cut: float) -> str:
    return f"{100 * cut:.0f}% fewer bytes" if cut >= 0 else f"{-100 * cut:.0f}% MORE bytes"


def mark(ok) -> str:
    return "-" if ok is None else ("met" if ok else "MISSED")


def seed_table(an: dict) -> list[str]:
    lines = [f"Seed {an['seed']}: target loss = plain all-reduce's final loss x 1.01 = {an['target_loss']:.4f}; loopback all-reduce "
             f"measured at {an['loopback_MBps']:.0f} MB/s (splits hook time into transfer and compute).", "",
             "| arm | steps | final loss | WikiText-2 ppl | bytes, matrices | reduction (matrices) | bytes, whole model | "
             "matrix bytes to target | compute/step (ms) | break-even link (MB/s) | monitor share | mean / final rank | load (1-min, before/after) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in an["rows"].items():
        be = r["break_even_MBps"]
        bes = "-" if be is None else ("any" if be == float("inf") else f"{be:,.0f}")
        fl = "-" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        ppl = "-" if r["ppl"] is None else f"{r['ppl']:.1f}"
        rk = "-" if r["final_rank"] is None else f"{r['mean_rank']:.1f} / {r['final_rank']}"
        ld = "-" if not r.get("load") else f"{r['load'][0]:.1f} / {r['load'][1]:.1f}"
        lines.append(f"| {arm} | {r['steps']} | {fl} | {ppl} | {fmt_bytes(r['bytes_matrices'])} | {r['matrix_ratio']:.2f}x | "
                     f"{fmt_bytes(r['bytes_total'])} | {fmt_bytes(r['matrix_bytes_to_target']) if r['steps'] == an['rows']['none']['steps'] else '-'} | "
                     f"{1e3 * r['compute_s_per_step']:.1f} | {bes} | {100 * r['monitor_share']:.2f}% | {rk} | {ld} |")
    return lines


def goal_table(judged: list[dict], post_hoc: set[str], tuning_seed: int | None = None) -> list[str]:
    """Per-seed goals; a post-hoc arm (chosen on `tuning_seed`) is labelled per row and averaged over the held-out seeds."""

    def label(arm: str, seed: int | None) -> str:
        if arm not in post_hoc:
            return arm
        return f"{arm} ({'tuning run' if seed == tuning_seed else 'held out'})" if seed is not None else f"{arm} (held-out seeds)"

    lines = ["| seed | arm | final loss vs plain (<= +1%) | matrix bytes vs plain (>= 10x) | whole-model bytes | "
             "vs the cheapest fixed rank within 1% of plain's loss (>= 30% fewer) | monitor share (<= 3%) | mean rank | zip bit-identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for j in judged:
        ranks = "/".join(map(str, j.get("fixed_ranks", [])))
        cut = (f"none of ranks {ranks} reached the target" if j["cheapest"] is None else
               f"{j['cheapest']} ({100 * j['cheapest_loss_delta']:+.2f}%; of ranks {ranks}): {fewer(j['cut'])}, {mark(j['cut_met'])}")
        z = "-" if "zip_identical" not in j else f"{'yes' if j['zip_identical'] else 'NO'} ({j['zip_steps']} steps)"
        lines.append(f"| {j['seed']} | {label(j['arm'], j['seed'])} | {100 * j['loss_delta']:+.2f}%, {mark(j['loss_met'])} | {j['matrix_ratio']:.1f}x, "
                     f"{mark(j['ratio_met'])} | {j['total_ratio']:.1f}x | {cut} | {100 * j['monitor_share']:.2f}%, {mark(j['monitor_met'])} | "
                     f"{j['mean_rank']:.1f} | {z} |")
    for arm in sorted({j["arm"] for j in judged}):
        js = [j for j in judged if j["arm"] == arm and not (arm in post_hoc and j["seed"] == tuning_seed)]
        if len(js) < 2:
            continue
        cuts = [j["cut"] for j in js if j["cut"] is not None]
        cut = f"{fewer(sum(cuts) / len(cuts))} (mean of {len(cuts)})" if cuts else "-"
        lines.append(f"| mean | {label(arm, None)} | {100 * sum(j['loss_delta'] for j in js) / len(js):+.2f}% | "
                     f"{sum(j['matrix_ratio'] for j in js) / len(js):.1f}x | {sum(j['total_ratio'] for j in js) / len(js):.1f}x | {cut} | "
                     f"{100 * sum(j['monitor_share'] for j in js) / len(js):.2f}% | {sum(j['mean_rank'] for j in js) / len(js):.1f} | - |")
    return lines


def plot(per_seed: dict[int, dict], path: Path, skip: set[str] = frozenset()) -> None:
    """Loss over cumulative bytes and EDGC's rank/entropy traces per seed (arms in `skip` left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted(per_seed)
    fig, axes = plt.subplots(len(seeds), 2, figsize=(12, 3.4 * len(seeds)), squeeze=False)
    for (a, b), seed in zip(axes, seeds):
        results = per_seed[seed]
        for arm in [x for x in arm_order(results) if x not in skip]:
            res = results[arm]
            cum, xs = 0, []
            for r in res["recs"]:
                cum += r["comm_matrix_bytes"]
                xs.append(cum / 1e6)
            k = 10
            ys = [sum(x["loss"] for x in res["recs"][max(0, i - k + 1) : i + 1]) / min(k, i + 1) for i in range(len(res["recs"]))]
            a.plot(xs, ys, label=arm, lw=1)
        a.set_xscale("log")
        a.set_xlabel("cumulative bytes sent per rank, matrices (MB, log)")
        a.set_ylabel(f"seed {seed}: training loss (10-step mean)")
        a.legend(fontsize=7)
        b2 = b.twinx()
        for arm in [x for x in arm_order(results) if x.startswith("edgc") and x not in skip]:
            rt, et = results[arm]["rank_trace"], results[arm]["entropy_trace"]
            xs = [i for i, r in enumerate(rt) if r is not None]
            b.step(xs, [rt[i] for i in xs], where="post", label=f"{arm} rank")
            es = [(i, h) for i, h in enumerate(et) if h is not None]
            b2.plot([i for i, _ in es], [h for _, h in es], ".", ms=2, alpha=0.6)
        b.set_xlabel("step")
        b.set_ylabel("EDGC rank (lines)")
        b2.set_ylabel("reduced-gradient entropy, bits (dots)")
        b.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    from llmcompress.io.atomic import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def main() -> None:
    from llmcompress.comm.edgc import ENTROPY_SPAN, WARMUP

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    ap.add_argument("--arms", default=",".join(ARMS), help="none, zip, psgdR (rank R), edgc, edgcN (EDGC with r_max N), edgcNsX (and span X)")
    ap.add_argument("--zip-steps", type=int, default=None, help="stop the zip arm after this many steps (default: --steps)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--start", type=int, default=WARMUP, help="dense warm-up steps of every compressed arm")
    ap.add_argument("--span", type=float, default=ENTROPY_SPAN)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--post-hoc", default="", help="arms whose settings were chosen after seeing the first seed's results "
                    "(labelled so; their means cover the other, held-out seeds)")
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--work", default="/tmp/bench_edgc")
    ap.add_argument("--reuse", action="store_true", help="take every arm already stored in --work/seedS instead of rerunning it")
    ap.add_argument("--report-only", action="store_true", help="run nothing: report the arms stored in --work/seedS")
    ap.add_argument("--note", default="", help="a paragraph for the report's header (e.g. which invocations ran the arms)")
    ap.add_argument("--no-write", action="store_true", help="print, do not write bench/RESULTS-edgc.*")
    a = ap.parse_args()
    try:
        seeds = [int(x) for x in a.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds takes comma-separated integers, got {a.seeds!r}")
    arms = [x for x in a.arms.split(",") if x]
    for arm in arms:
        m = ARM_RE.fullmatch(arm)
        if m is None or (m[3] is not None and not 0 < float(m[3]) <= 1):
            ap.error(f"unknown arm {arm!r}: none, zip, psgdR, edgc, edgcN (r_max N), edgcNsX / edgcsX (entropy span X in (0, 1]), +q (carry Q)")
    zip_steps = a.steps if a.zip_steps is None else min(a.zip_steps, a.steps)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    base = {"steps": a.steps, "vocab": a.vocab, "seq": a.seq, "batch": a.batch, "lr": a.lr, "start": a.start, "span": a.span,
            "eval_tokens": a.eval_tokens, "zip_steps": zip_steps, "data": str(prepare(a.vocab, work))}
    per_seed, analyses, judged = {}, [], []
    for seed in seeds:
        args = dict(base, seed=seed)
        sw = work / f"seed{seed}"
        sw.mkdir(exist_ok=True)
        results = {}
        for arm in arms:
            f = sw / f"{arm}.json"
            if a.report_only and not f.is_file():
                continue
            if (a.reuse or a.report_only) and f.is_file():
                results[arm] = json.loads(f.read_text())
                print(f"seed {seed} {arm}: reused {f}", flush=True)
                continue
            results[arm] = run_arm(arm, args, sw)
            f.write_text(json.dumps(results[arm]))  # with wall_s and load
            r = results[arm]
            print(f"seed {seed} {arm}: final loss {final_loss(r['recs']):.4f} bytes {sum(x['comm_bytes'] for x in r['recs']) / 1e6:.1f} MB "
                  f"wall {r['wall_s']:.0f}s load {r['load']}", flush=True)
        per_seed[seed] = results
        if "none" not in results:
            continue
        an = analyse(results, args)
        analyses.append(an)
        judged += [judge(an, arm) for arm in an["rows"] if arm.startswith("edgc")]
    if not analyses:
        return
    post_hoc = {x for x in a.post_hoc.split(",") if x}
    first = per_seed[seeds[0]]["none"]
    loads = [x for res in per_seed.values() for r in res.values() for x in (r.get("load") or [])]
    cmd = "python bench/bench_edgc.py " + " ".join(sys.argv[1:])
    lines = ["# EDGC benchmark", "",
             f"`{cmd}` (under nice {os.nice(0)}), {_dt.date.today()}, {os.cpu_count()}-core {cpu_model()}, shared with other jobs (1-minute load average "
             f"{min(loads):.1f}-{max(loads):.1f} across the arms); 2 gloo processes (torch.set_num_threads(1) each); reduced LLaMA {MODEL} "
             f"with vocab {a.vocab} ({first['params']:,} parameters, {first['matrix_params']:,} in decoder matrices); trained on WikiText-2 "
             f"valid, perplexity on test, {a.steps} steps, global batch {a.batch} x {a.seq} tokens, AdamW lr {a.lr}. Every compressed arm "
             f"(PowerSGD at a fixed rank, EDGC) sends plain all-reduces for its first {a.start} steps (torch's start_powerSGD_iter). "
             f"EDGC: {EDGC}, entropy span {a.span} of the peak windowed entropy. Seeds {','.join(map(str, seeds))}: each draws the initial "
             "weights, the order of the training blocks and PowerSGD's random vectors, the same for every arm.", "",
             "Monitor share = time in EDGC's entropy sampling and window bookkeeping / step time, both measured inside the same steps "
             "of the same run (so load hits numerator and denominator alike).", ""]
    if a.note:
        lines += [a.note, ""]
    if post_hoc:
        lines += [f"Post hoc: {', '.join(sorted(post_hoc))} chosen after seeing seed {seeds[0]}'s results (the tuning seed); "
                  f"{'seeds ' + ','.join(map(str, seeds[1:])) + ' are held out for it' if seeds[1:] else 'no held-out seed in this report'}.", ""]
    lines += ["## Goals per seed", "", *goal_table(judged, post_hoc, seeds[0]), ""]
    for an in analyses:
        lines += [f"## Seed {an['seed']}", "", *seed_table(an), ""]
    md = "\n".join(lines) + "\n"
    print(md)
    if a.no_write:
        return
    out = Path(a.out)
    from llmcompress.io.atomic import write_text

    write_text(out / "RESULTS-edgc.md", md)
    traces = {str(s): {k: {"loss": [r["loss"] for r in v["recs"]], "rank": v.get("rank_trace"), "entropy": v.get("entropy_trace")}
                       for k, v in res.items()} for s, res in per_seed.items()}
    write_text(out / "RESULTS-edgc.json", json.dumps({"args": base, "seeds": seeds, "analyses": analyses, "goals": judged,
                                                               "post_hoc": sorted(post_hoc), "traces": traces}, indent=1))
    plot(per_seed, out / "RESULTS-edgc-trace.png", skip=post_hoc if len(seeds) > 1 else set())  # the tuning runs: in the tables


if __name__ == "__main__":
    sys.exit(main())
