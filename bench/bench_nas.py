"""Benchmark of `llmcompress nas` against fair mixed-precision baselines on smollm2-135m (issue 19).

Every row uses the same quantizer (one GPTQ bank per seed: act-order, static groups, group size 64
asymmetric, Hessians of the teacher on the search's 128 calibration blocks; nas/qbank.py), the same
held-out calibration blocks for its validated step, and is evaluated the same way. At an average-bits target
(latency unconstrained) the rows are:

* uniform: the best feasible uniform bit width (the widest whose average meets the target);
* llama.cpp-style: uniform at the lower level, attn_v and ffn_down raised a level in the layers llama.cpp's
  `use_more_bits` picks (first and last eighth, every third in between), paid for by lowering gate/up
  elsewhere; budget left is spent on further attn_v/ffn_down raises;
* knapsack: per-linear measured KL (each linear quantized alone at each width, the rest float, on
  --measure-blocks calibration blocks), then the Lagrangian knapsack of bench_nas_alloc.py;
* evopress: (1+lambda) evolutionary search with level-switch mutations (nas/refine.mutate) scored by the
  held-out KL, started from the budget-filled uniform plan, with the same number of forward tokens as
  joint's gradient phase + validated step;
* sequential: NAS-then-quantize (nas/search.py:search_sequential): oracle split of stage 1's full-precision
  target and quantization-aware stage 1, best by the validated step, which may also keep uniform; at a
  bits-only target its architecture stage has no budget, so this is the mixed-precision-only search (bits
  searched on the dense model with half the gradient steps, then the validated step);
* joint: the gradient search (proxy-initialised logits), then the validated step with --refine-evals;
* joint, 0 steps: the ablation proxy + repair/upgrade + validated step (no gradient phase);
* joint, kappa 0: the ablation with equal starting logits;
* joint, measured init: 0 steps, the bit logits started from each linear's measured KL (`bits_init:
  measured`, nas/sensitivity.linear_kl) instead of the proxy, on the search's own calibration blocks.

Metrics: held-out calibration KL (what the validated steps optimise), WikiText-2 raw test perplexity on the
first --eval-tokens tokens (windows of 512), tinyshakespeare (last 10 %) perplexity and per-token KL to the
teacher on --ood-tokens tokens, PIQA accuracy with its standard error on the first --piqa-limit questions
(lm-eval, 0-shot). GPTQ banks and per-linear KL tables are cached under --work.

    .venv/bin/python bench/bench_nas.py [--targets 3.0,2.5] [--seeds 0] [--eval-tokens 32768] [--work /tmp/llmc-bench-nas]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of layers that get more bits for attn_v / ffn_down (llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def llamacpp_plan(space, costs, targets, base):
    from llmcompress.nas.space import Arch, violation

    names = space.linears
    v, d, g, u = (names.index(x) for x in ("self_attn.v_proj", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"))
    n = space.n_layers
    arch = Arch.dense(space, base)
    more = [i for i in range(n) if use_more_bits(i, n)]
    rest = [i for i in range(n) if i not in more]
    raises = [(i, j) for i in more for j in (v, d)] + [(i, j) for i in rest for j in (v, d)] + [(i, v) for i in more]
    lowers = [(i, j) for i in reversed(rest) for j in (g, u)]

    def ok(a):
        return violation(costs.metrics(a), targets) <= 1e-9

    for i, j in raises:
        if arch.bits[i][j] >= len(space.bits) - 1:
            continue
        trial = arch.copy()
        trial.bits[i][j] += 1
        spent = []
        while not ok(trial) and lowers:
            li, lj = lowers.pop(0)
            if trial.bits[li][lj] > 0:
                trial.bits[li][lj] -= 1
                spent.append((li, lj))
        if ok(trial):
            arch = trial
        else:
            lowers = spent + lowers
            break
    return arch


def measure_table(model, space, bank, blocks):
    """KL of every linear quantized alone at every bit width (the rest float), on `blocks`, keyed "i.j.k"
    (nas/sensitivity.linear_kl, the table `bits_init: measured` starts joint from)."""
    from llmcompress.nas.sensitivity import linear_kl

    t = linear_kl(model, space, blocks, bank)
    return {f"{i}.{j}.{k}": float(t[i, j, k]) for i in range(t.shape[0]) for j in range(t.shape[1]) for k in range(t.shape[2])}


def knapsack_plan(space, table, target):
    from bench_nas_alloc import knapsack

    from llmcompress.nas.space import Arch

    units = [(i, j) for i in range(space.n_layers) for j in range(len(space.linears))]
    ks = list(range(len(space.bits)))
    numel = {u: space.shapes[space.linears[u[1]]][0] * space.shapes[space.linears[u[1]]][1] for u in units}
    # knapsack() minimises over bit values weighted by numel: give it the bit widths, then map back
    tab = {u: {space.bits[k]: table[f"{u[0]}.{u[1]}.{k}"] for k in ks} for u in units}
    ch, _ = knapsack(tab, numel, units, list(space.bits), target)
    arch = Arch.dense(space, 0)
    for (i, j), b in ch.items():
        arch.bits[i][j] = space.bits.index(b)
    return arch


def evopress(model, net, space, costs, targets, start, blocks, evals, lam, seed):
    """(1+lambda) search: each generation `lam` level-switch offspring of the parent, the best replaces the
    parent when its measured KL is lower. Returns (arch, kl, evaluations)."""
    import random

    from llmcompress.nas.refine import arch_kl, mutate, same_arch
    from llmcompress.nas.sensitivity import reference_logp

    ref = reference_logp(model, blocks)
    rng = random.Random(seed)
    best, best_kl = start, arch_kl(model, net, start, blocks, ref)
    used = 1
    while used + lam <= evals:
        kids = []
        for _ in range(lam):
            for _ in range(20):
                c = mutate(space, best, costs, targets, rng, {"bits"})
                if c is not None and not any(same_arch(c, k) for k in kids):
                    kids.append(c)
                    break
        scored = [(arch_kl(model, net, c, blocks, ref), c) for c in kids]
        used += len(kids)
        if scored:
            kl, c = min(scored, key=lambda t: t[0])
            if kl < best_kl:
                best, best_kl = c, kl
    return best, best_kl, used


def ood_metrics(model, teacher, blocks, batch=4):
    """(perplexity, mean per-token KL(teacher || model)) on `blocks`."""
    import math

    import torch
    import torch.nn.functional as F

    nll = kl = 0.0
    n = 0
    with torch.no_grad():
        for b in blocks.split(batch):
            s = F.log_softmax(model(input_ids=b, use_cache=False).logits.float(), -1)
            t = F.log_softmax(teacher(input_ids=b, use_cache=False).logits.float(), -1)
            nll -= float(s[:, :-1].gather(-1, b[:, 1:, None]).sum())
            kl += float((t.exp() * (t - s)).sum(-1).sum())
            n += b.numel()
    return math.exp(nll / (n - blocks.shape[0])), kl / n


MD_HEADER = """# llmcompress nas benchmark results (`bench/bench_nas.py`)

Written by the bench after each run: means over the seeds present in the results file. The settings of
each run (seeds, targets, quantizer, tokens) and the goals met or missed are in BENCHMARKS.md ("Joint NAS
+ mixed precision"). The runs of 2026-12-02 that this file held before (4-bit target, `packed/` sizes,
"joint vs sequential" at 0.6 latency) are withdrawn: see BENCHMARKS.md for why.

"""


def summarize(results: list[dict]) -> str:
    """Markdown table of a results file: one row per (target, method), mean over seeds (and the seed count)."""
    from statistics import mean

    keys = ["avg_bits", "heldout_kl", "wikitext2_ppl", "shakespeare_ppl", "shakespeare_kl", "piqa_acc", "piqa_stderr"]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["target_bits"], r["method"]), []).append(r)
    lines = ["| target bits | method | seeds | avg bits | held-out KL | WikiText-2 ppl | ppl / uniform | tinyshakespeare ppl | "
             "tinyshakespeare KL | KL / uniform | PIQA acc ± stderr | bits used (count of linears) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (t, m), rs in groups.items():
        v = {k: mean(r[k] for r in rs) if all(r.get(k) is not None for r in rs) else None for k in keys}
        u = groups.get((t, "uniform"))  # absent from a partial results file (one --methods group)
        up = mean(r["wikitext2_ppl"] for r in u) if u else float("nan")
        uk = mean(r["shakespeare_kl"] for r in u) if u else float("nan")
        hist = rs[0]["bits_histogram"]
        lines.append(
            f"| {t} | {m} | {len(rs)} | {v['avg_bits']:.3f} | {v['heldout_kl']:.4f} | {v['wikitext2_ppl']:.2f} | "
            f"{v['wikitext2_ppl'] / up:.3f} | {v['shakespeare_ppl']:.2f} | {v['shakespeare_kl']:.4f} | {v['shakespeare_kl'] / uk:.3f} | "
            + (f"{v['piqa_acc']:.3f} ± {v['piqa_stderr']:.3f}" if v["piqa_acc"] is not None else "—")
            + " | " + ", ".join(f"{b}b:{n}" for b, n in sorted(hist.items(), key=lambda x: int(x[0]))) + " |")
    return "\n".join(lines)


def main() -> None:
    if "--summarize" in sys.argv:
        print(summarize(json.loads(Path(sys.argv[sys.argv.index("--summarize") + 1]).read_text())))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="3.0,2.5")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--bits", default="2,3,4,5,6,8")
    ap.add_argument("--train-tokens", type=int, default=16384)
    ap.add_argument("--quant", default="gptq", choices=["gptq", "rtn"], help="the one quantizer of every row")
    ap.add_argument("--gptq-blocks", type=int, default=128)
    ap.add_argument("--refine-blocks", type=int, default=8)
    ap.add_argument("--refine-evals", type=int, default=16)
    ap.add_argument("--measure-blocks", type=int, default=2)
    ap.add_argument("--table-tokens", type=int, default=128, help="tokens of each measurement block used by the per-linear table")
    ap.add_argument("--search-steps", type=int, default=None, help="gradient steps of joint (default: one per batch of --train-tokens)")
    ap.add_argument("--methods", default="", help="comma-separated name prefixes to run (default: all), or ';'-separated "
                    "when a prefix has a comma ('uniform;joint, 0 steps'); '=NAME' matches NAME only ('=joint'); e.g. to split "
                    "the run over processes")
    ap.add_argument("--lam", type=int, default=4)
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--ood-tokens", type=int, default=8192)
    ap.add_argument("--piqa-limit", type=int, default=500)
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmc-bench-nas"))
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS-nas.json")
    a = ap.parse_args()
    import torch

    from llmcompress.eval.lmeval import run_lm_eval
    from llmcompress.eval.perplexity import perplexity, perplexity_blocks
    from llmcompress.io.load import load_model
    from llmcompress.nas import export as E
    from llmcompress.nas import search as S
    from llmcompress.nas.config import NasConfig
    from llmcompress.nas.cost import build_cost_models
    from llmcompress.nas.pipeline import search_blocks
    from llmcompress.nas.qbank import QuantBank
    from llmcompress.nas.refine import arch_kl
    from llmcompress.nas.sensitivity import reference_logp
    from llmcompress.nas.space import build_space, mlp_channel_importance, permute_mlp_, upgrade
    from llmcompress.nas.supernet import Supernet

    a.work.mkdir(parents=True, exist_ok=True)
    want = [m.strip() for m in a.methods.split(";" if ";" in a.methods else ",") if m.strip()]

    def wanted(name):
        return not want or any(name == w[1:] if w.startswith("=") else name.startswith(w) for w in want)

    bits = [int(x) for x in a.bits.split(",")]
    targets = [float(x) for x in a.targets.split(",")]
    results = json.loads(a.results.read_text()) if a.results.is_file() else []
    lm = load_model("smollm2-135m")
    tok = lm.tokenizer
    lm.model = None  # each seed loads its own copy (channel ranking depends on the data)
    ood = perplexity_blocks(tok, "tinyshakespeare", split="valid", seq_len=512, max_tokens=a.ood_tokens)
    for seed in [int(s) for s in a.seeds.split(",")]:
        torch.manual_seed(seed)
        base = NasConfig(target_bits=targets[0], bits=bits, seed=seed, train_tokens=a.train_tokens, refine_blocks=a.refine_blocks,
                         refine_evals=a.refine_evals, eval_tokens=0, measure_speed=False, search_steps=a.search_steps,
                         quant_method=a.quant, gptq_blocks=a.gptq_blocks)
        model = load_model("smollm2-135m").model
        space = build_space(model, base)
        costs = build_cost_models(model, space, "analytic", base.context_len)
        blocks, held = search_blocks(tok, base)
        permute_mlp_(model, [i.argsort(descending=True, stable=True) for i in mlp_channel_importance(model, blocks[:8])])
        t0 = time.time()
        bpath = a.work / f"bank_{a.quant}{a.gptq_blocks if a.quant == 'gptq' else ''}_s{seed}_tt{a.train_tokens}_{'-'.join(map(str, bits))}.pt"
        if bpath.is_file():
            bank = QuantBank(space, a.quant, False, True, torch.load(bpath, weights_only=True))
            mods = dict(model.named_modules())
            bank.floats = {(i, j): mods[space.fqn(i, n)].weight.detach() for i in range(space.n_layers) for j, n in enumerate(space.linears)}
        else:
            bank = S.bank_for(model, space, base, blocks)
            torch.save(bank.entries, bpath)
        t_bank = time.time() - t0
        tpath = a.work / f"table_{a.quant}{a.gptq_blocks if a.quant == 'gptq' else ''}_s{seed}_tt{a.train_tokens}_{'-'.join(map(str, bits))}_{a.measure_blocks}x{a.table_tokens}.json"
        t0 = time.time()
        table = None
        if tpath.is_file():
            table = json.loads(tpath.read_text())
        elif wanted("knapsack"):
            table = measure_table(model, space, bank, blocks[-a.measure_blocks:, : a.table_tokens])
            tpath.write_text(json.dumps(table))
        t_table = time.time() - t0
        print(f"seed {seed}: bank {t_bank:.0f}s, table {t_table:.0f}s", flush=True)
        net = Supernet(model, space, bank)
        ref_h = reference_logp(model, held)
        tokens_fwd_per_eval = held.numel()
        for target in targets:
            cfg = dataclasses.replace(base, target_bits=target)
            tg = cfg.targets()
            plans: dict[str, tuple] = {}
            t0 = time.time()
            uni = S.search_uniform(space, costs, cfg).arch
            plans["uniform"] = (uni, {"seconds": time.time() - t0})
            base_idx = uni.bits[0][0]
            t0 = time.time()
            plans["llama.cpp-style"] = (llamacpp_plan(space, costs, tg, base_idx), {"seconds": time.time() - t0})
            if table is not None:
                plans["knapsack (measured per-linear KL)"] = (knapsack_plan(space, table, target),
                                                              {"seconds": t_table, "evaluations": len(table),
                                                               "tokens_per_evaluation": a.measure_blocks * a.table_tokens})
            runs = {"joint": cfg, "joint, 0 steps (proxy + repair)": dataclasses.replace(cfg, search_steps=0),
                    "joint, kappa 0": dataclasses.replace(cfg, init_kappa=0.0),
                    "joint, measured init": dataclasses.replace(cfg, search_steps=0, bits_init="measured")}
            for name, c in runs.items():
                if not wanted(name):
                    continue
                out = a.work / f"run_s{seed}_t{target}_{name.split(',')[0]}_{c.grad_steps}_{c.init_kappa}_{c.bits_init}"
                out.mkdir(parents=True, exist_ok=True)
                for p in out.glob("*"):
                    p.unlink()
                t0 = time.time()
                res = S.search_joint(model, space, costs, c, blocks, out, False, held, bank=bank)
                plans[name] = (res.arch, {"seconds": time.time() - t0, "refine": res.refine, "grad_steps": c.grad_steps})
            if wanted("sequential"):
                out = a.work / f"run_s{seed}_t{target}_seq"
                out.mkdir(parents=True, exist_ok=True)
                for p in out.glob("*"):
                    p.unlink()
                t0 = time.time()
                res = S.search_sequential(model, space, costs, cfg, blocks, out, False, held, bank=bank)
                plans["sequential (= mixed precision only here)"] = (res.arch, {"seconds": time.time() - t0, "refine": res.refine})
            # EvoPress at equal forward tokens: joint's gradient steps (teacher + student forward + backward
            # ~ 4 forwards of seq_len * batch_size tokens each) plus its validated-step evaluations
            grad_tokens = 4 * cfg.grad_steps * cfg.seq_len * cfg.batch_size
            evo_evals = cfg.refine_evals + 2 + grad_tokens // tokens_fwd_per_eval
            if wanted("evopress"):
                t0 = time.time()
                start = upgrade(space, uni, None, costs, tg)
                arch, _, used = evopress(model, net, space, costs, tg, start, held, evo_evals, a.lam, seed + 31)
                plans["evopress (1+λ)"] = (arch, {"seconds": time.time() - t0, "evaluations": used})
            for name, (arch, info) in plans.items():
                if not wanted(name):
                    continue
                m = costs.metrics(arch)
                assert m["bits"] <= target + 1e-9, (name, m)
                kl = arch_kl(model, net, arch, held, ref_h)
                derived = E.derive_model(model, space, arch)
                E.apply_bank(derived, space, arch, bank)
                ppl = perplexity(derived, tok, "wikitext2", seq_len=512, max_tokens=a.eval_tokens)["ppl"]
                ood_ppl, ood_kl = ood_metrics(derived, model, ood)
                piqa = {}
                if a.piqa_limit:
                    r = run_lm_eval(derived, tok, ["piqa"], limit=a.piqa_limit, batch_size=16)["piqa"]
                    piqa = {"piqa_acc": r.get("acc"), "piqa_stderr": r.get("acc_stderr")}
                counts = {}
                for row in arch.bits:
                    for b in row:
                        counts[space.bits[b]] = counts.get(space.bits[b], 0) + 1
                rec = {"seed": seed, "target_bits": target, "method": name, "quant": a.quant, "avg_bits": m["bits"], "modeled_latency": m["latency"],
                       "size_mb": m["size_mb"], "heldout_kl": kl, "wikitext2_ppl": ppl, "shakespeare_ppl": ood_ppl,
                       "shakespeare_kl": ood_kl, **piqa, "bits_histogram": counts, "kept": sum(arch.keep),
                       "info": {k: v for k, v in info.items()}, "eval_tokens": a.eval_tokens, "ood_tokens": int(ood.numel()),
                       "piqa_limit": a.piqa_limit, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
                print(json.dumps({k: v for k, v in rec.items() if k not in ("info",)}), flush=True)
                # a rerun of a row (e.g. `--methods sequential` after a fix) replaces it instead of averaging with it
                results = [r for r in results if (r["seed"], r["target_bits"], r["method"]) != (seed, target, name)]
                results.append(rec)
                a.results.write_text(json.dumps(results, indent=1))
                del derived
        del net, bank, model
    md = a.results.with_suffix(".md")
    md.write_text(MD_HEADER + f"Raw rows: `{a.results.name}`.\n\n" + summarize(results) + "\n")
    print(f"wrote {a.results} and {md}")


if __name__ == "__main__":
    os.environ.setdefault("LLMCOMPRESS_PROGRESS", "0")
    main()
