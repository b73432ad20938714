"""Benchmark: ShortGPT, LaCo, drop-search and GeLaCo at 26/22/18 layers on smollm2-135m, side by side.

    LLMCOMPRESS_DATA_DIR=/work/shared/data LLMCOMPRESS_PROGRESS=0 python bench/bench_collapse.py \
        [--calib-tokens 4096 --val-tokens 2048 --population 8 --generations 4 --ppl-tokens 32768 --shakespeare-tokens 8192]

Writes bench/RESULTS-collapse.md. Searches run once each in Pareto mode (NSGA-II, 18..29 layers); the
solution at each budget is the best on calibration re-ranked by validation (never optimized on), then
refined with racing (`llmcompress/collapse/refine.py`, `--refine-steps`: swap moves, then for gelaco swaps and
merge-coefficient changes), keeping the walk's best point on validation. drop-search runs first; gelaco's
population is seeded with its final solutions as well as ShortGPT's and LaCo's.
Perplexity: WikiText-2 raw test (first --ppl-tokens tokens) and tinyshakespeare valid, both at seq-len 512.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

BUDGETS = (26, 22, 18)


def evals_per_second(ev, cands, use_prefix: bool, use_reference: bool = True) -> float:
    """Evaluations per second on `cands` (memo cleared before and restored after)."""
    saved = dict(ev.memo)
    ev.use_prefix, ev.use_reference = use_prefix, use_reference
    ev.memo.clear()
    ev._sim_memo.clear()
    t0 = time.perf_counter()
    for c in cands:
        ev.evaluate(c)
    secs = time.perf_counter() - t0
    ev.use_prefix, ev.use_reference = True, True
    ev.memo.clear()
    ev.memo.update(saved)
    return len(cands) / secs


def speed_main(args) -> None:
    """--speed: evaluations per second of the fitness on a fixed set of candidates, one speed-up at a time."""
    import random
    import tempfile

    import numpy as np
    import torch
    from scipy.stats import kendalltau

    from llmcompress.collapse import baselines as B
    from llmcompress.collapse.config import CollapseConfig, native_bf16_cpu, resolve_fitness_dtype
    from llmcompress.collapse.fitness import Evaluator, PrefixStates, prepare
    from llmcompress.collapse.refine import swap_neighbours
    from llmcompress.collapse.search import make_space, run_search
    from llmcompress.io.load import load_model

    load0 = os.getloadavg()[0]
    lm = load_model("smollm2-135m")
    base = CollapseConfig()
    cfg = dataclasses.replace(base, calib_tokens=args.calib_tokens or base.calib_tokens, val_tokens=base.seq_len,
                              population=args.population or base.population, generations=args.generations or base.generations,
                              min_layers=min(BUDGETS), racing=False)
    # the fixed candidates: what a search of the default spec evaluates, in its order (found with a one-block
    # proxy fitness, seeded with ShortGPT's drop sets; LaCo's are left out to keep this quick), and a walk's
    # neighbours at 22 layers
    proxy = prepare(dataclasses.replace(cfg, calib_tokens=cfg.seq_len), lm)
    scores = B.shortgpt_scores(proxy)
    seeds = [B.shortgpt(proxy, n, scores) for n in BUDGETS]
    for c in seeds:
        proxy.evaluate(c)
    with tempfile.TemporaryDirectory() as d:
        run_search(cfg, proxy, seeds, Path(d), model_id="smollm2-135m")
    search_set = [c for c in proxy.archive.values() if c.first_changed() is not None][: args.speed_sample]
    space = make_space(cfg, proxy.n_layers, seeds)
    neigh = [space.decode(y) for y in swap_neighbours(space, space.encode(seeds[1]))]
    walk_set = [seeds[1]] + random.Random(0).sample(neigh, min(args.speed_sample // 2, len(neigh)))
    proxy.close()
    del proxy

    ev = prepare(cfg, lm)
    threads = torch.get_num_threads()
    cpu_bf16 = native_bf16_cpu()
    modes = [
        ("cached path (original's prefix, fp32; before)", dict(prefix=0.0, dtype="float32", batch=cfg.batch_blocks)),
        ("(e) 8 blocks per forward instead of 4", dict(prefix=0.0, dtype="float32", batch=2 * cfg.batch_blocks)),
        ("(b) + candidates' prefix states (fp32)", dict(prefix=cfg.prefix_cache_gb, dtype="float32", batch=cfg.batch_blocks)),
        ("(a) + bf16 layers, KL fp32", dict(prefix=cfg.prefix_cache_gb, dtype="bfloat16", batch=cfg.batch_blocks)),
    ]
    # one evaluator per mode on the same cached references; each candidate is scored by every mode in turn
    # (interleaved), so that the load of a shared machine weighs on every mode alike
    evs = [Evaluator(lm.model, ev.refs["calib"], ev.refs["val"], w_kl=cfg.w_kl, w_sim=cfg.w_sim, sim_blocks=cfg.sim_blocks,
                     batch=m["batch"], prefix_bytes=m["prefix"] * 2**30, compute_dtype=m["dtype"]) for _, m in modes]
    n_blocks = ev.refs["calib"].n_blocks
    res = {}
    for label, cands in (("search", search_set), ("walk", walk_set)):
        secs = [0.0] * len(evs)
        for e in evs:
            e.stats.layers_run = 0
        fits = [[] for _ in evs]
        for c in cands:
            for i, e in enumerate(evs):
                t0 = time.perf_counter()
                fits[i].append(e.evaluate(c).fitness)
                secs[i] += time.perf_counter() - t0
            print(label, c.describe(), [round(x, 1) for x in secs], flush=True)
        for i, e in enumerate(evs):
            res[(i, label)] = (len(cands) / secs[i], fits[i], e.stats.layers_run / n_blocks / len(cands))
    before = 0
    lines = [
        "# Collapse fitness speed (smollm2-135m, bench/bench_collapse.py --speed)",
        "",
        f"Default spec, {cfg.calib_tokens} calibration tokens ({n_blocks} blocks of {cfg.seq_len}), "
        f"kl_stride {cfg.kl_stride}, top-{cfg.kl_topk}; {torch.get_num_threads()} torch thread(s) on {os.cpu_count()} CPU cores "
        f"(shared machine, load average {load0:.1f} at start; native bf16 matmuls: {cpu_bf16}); "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Candidates: the first {len(search_set)} a default --pareto search "
        f"evaluates (seeded with ShortGPT at {list(BUDGETS)}; found with a one-block proxy fitness), and ShortGPT's 22-layer "
        f"drop set with {len(walk_set) - 1} of its swap neighbours (a walk step). Every mode has its own caches, starts empty, and "
        "scores each candidate right after the other modes (interleaved, so a shared machine's load falls on all alike).",
        "",
        "| mode | search evals/s | speed-up | walk evals/s | speed-up | layers run per block (search / walk) | fitness vs before |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for i, (name, _) in enumerate(modes):
        diffs = []
        for label in ("search", "walk"):
            a, b = np.array(res[(before, label)][1]), np.array(res[(i, label)][1])
            if np.array_equal(a, b):
                diffs.append(f"{label}: bit-identical")
            else:
                tau = kendalltau(a, b).statistic
                diffs.append(f"{label}: max |diff| {np.max(np.abs(a - b)):.2e} (rel {np.max(np.abs(a - b) / np.abs(a)):.1e}), Kendall tau {tau:.3f}")
        s0, w0 = res[(0, "search")][0], res[(0, "walk")][0]
        lines.append(f"| {name} | {res[(i, 'search')][0]:.3f} | {res[(i, 'search')][0] / s0:.2f}x | {res[(i, 'walk')][0]:.3f} | "
                     f"{res[(i, 'walk')][0] / w0:.2f}x | {res[(i, 'search')][2]:.1f} / {res[(i, 'walk')][2]:.1f} | {'; '.join(diffs)} |")
        print(lines[-1], flush=True)
    ev.prefix = PrefixStates(cfg.prefix_cache_gb * 2**30)
    ev.compute_dtype = resolve_fitness_dtype(cfg.fitness_dtype)

    # (d) racing, in the search itself: the same search with and without it (fronts must be identical)
    race = []
    for pareto, label in ((True, "--pareto"), (False, "--target-layers 22")):
        runs = {}
        for racing in (False, True):
            rcfg = dataclasses.replace(cfg, racing=racing, pareto=pareto, target_layers=None if pareto else 22,
                                       min_layers=min(BUDGETS) if pareto else None)
            ev.memo.clear()
            ev.partial.clear()
            ev.archive.clear()
            ev.stats = type(ev.stats)()
            ms = seeds if pareto else [seeds[1]]
            t0 = time.perf_counter()
            for c in ms:
                ev.evaluate(c)
            with tempfile.TemporaryDirectory() as d:
                hist = run_search(rcfg, ev, ms, Path(d), model_id="smollm2-135m")
            secs = time.perf_counter() - t0
            front = [(c.key, f.fitness) for c, f, _ in hist[-1].front]
            runs[racing] = (secs, ev.stats.evaluations, ev.stats.pruned, front, ev.stats.layers_run)
            print(label, "racing" if racing else "exhaustive", runs[racing][:3], flush=True)
        (s0, n0, _, f0, l0), (s1, n1, p1, f1, l1) = runs[False], runs[True]
        race.append(f"| {label} | {n0} | {s0:.0f} s | {p1} of {n1} pruned | {s1:.0f} s | {s0 / s1:.2f}x (layers run {l0 / max(l1, 1):.2f}x fewer) | "
                    f"{'identical' if f0 == f1 else 'DIFFERENT'} |")
    lines += ["", f"(d) Racing in the search (population {cfg.population}, {cfg.generations} generations, prefix states, "
              f"{ev.compute_dtype} layers; the same search with and without racing):", "",
              "| search | evaluations | exhaustive | racing | search time | speed-up | final front |", "|---|---:|---:|---:|---:|---:|---|", *race]
    # (d) racing in the walk's screening: one step's neighbours screened on refine_screen_blocks blocks, the
    # refine_top best kept; with racing against without (fresh caches each; the same top must come out)
    from llmcompress.collapse.refine import SCREEN, add_screen, screen

    sub = random.Random(1).sample(neigh, min(4 * args.speed_sample, len(neigh)))
    out = {}
    for racing in (False, True):
        e = Evaluator(lm.model, ev.refs["calib"], ev.refs["val"], w_kl=cfg.w_kl, w_sim=cfg.w_sim, sim_blocks=cfg.sim_blocks,
                      batch=cfg.batch_blocks, prefix_bytes=cfg.prefix_cache_gb * 2**30, compute_dtype=ev.compute_dtype)
        add_screen(e, cfg.refine_screen_blocks)
        e.evaluate(seeds[1], SCREEN)
        t0 = time.perf_counter()
        fits = screen(e, sub, cfg.refine_top) if racing else [e.evaluate(c, SCREEN) for c in sub]
        secs = time.perf_counter() - t0
        out[racing] = (secs, sorted((f.fitness, k) for k, f in enumerate(fits))[: cfg.refine_top], sum(f.partial for f in fits))
        print("screen", racing, out[racing], flush=True)
    lines += ["", f"(d) Racing in a walk step's screening ({len(sub)} swap neighbours of ShortGPT's 22-layer drop set on "
              f"{cfg.refine_screen_blocks} blocks, top {cfg.refine_top}): {out[False][0]:.0f} s without, {out[True][0]:.0f} s with "
              f"({out[False][0] / out[True][0]:.2f}x; {out[True][2]} stopped early); the same top {cfg.refine_top}: "
              f"{'yes' if out[False][1] == out[True][1] else 'NO'}."]
    ev.close()
    torch.set_num_threads(threads)
    text = "\n".join(lines) + "\n"
    args.speed_out.write_text(text)
    print(text)


def _cand(record):
    """The Candidate of a solution record (front.json / CollapseResult rows)."""
    from llmcompress.collapse.config import KINDS
    from llmcompress.collapse.space import Candidate

    groups = tuple(tuple(e["sources"]) for e in record["layer_map"])
    alphas = tuple(tuple(tuple(e["alpha"][k][j] for k in KINDS) for j in range(len(e["sources"]) - 1)) if "alpha" in e else ()
                   for e in record["layer_map"])
    return Candidate(groups, alphas)


def default_main(args) -> None:
    """--default-command: `llmcompress collapse --target-layers N` with the default spec (gelaco and drop-search),
    against the ShortGPT baseline of the same run, perplexity on WikiText-2 and tinyshakespeare."""
    import tempfile

    from llmcompress.collapse.config import CollapseConfig
    from llmcompress.collapse.export import build_model
    from llmcompress.collapse.pipeline import run_collapse
    from llmcompress.eval.perplexity import perplexity
    from llmcompress.io.load import load_model

    load0 = os.getloadavg()[0]
    lm = load_model("smollm2-135m")

    def ppl(model):
        w = perplexity(model, lm.tokenizer, "wikitext2", seq_len=512, max_tokens=args.ppl_tokens)["ppl"]
        t = perplexity(model, lm.tokenizer, "tinyshakespeare", split="valid", seq_len=512, max_tokens=args.shakespeare_tokens)["ppl"]
        return w, t

    dense = ppl(lm.model)
    rows = []
    for n in args.budgets:
        for method in args.methods:
            # --front: the NSGA-II search over every layer count, then the walk and tuning at n only
            cfg = CollapseConfig(pareto=args.front, target_layers=n, method=method, save=str(n), eval_tokens=0, piqa_limit=0)
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                res = run_collapse(cfg, Path(d) / "run", lm=lm)
                secs = time.perf_counter() - t0
            sol = next(r for r in res.front if r["layers"] == n)
            rows.append((method, n, *ppl(build_model(lm.model, _cand(sol))), sol["kl_val"], secs, res.evals_per_s, sol["changes"]))
            if method == "gelaco":
                base = next(r for r in res.baselines if r["method"] == "shortgpt" and r["layers"] == n)
                rows.append(("shortgpt", n, *ppl(build_model(lm.model, _cand(base))), base["kl_val"], 0.0, float("nan"), base["changes"]))
            print(rows[-1], flush=True)
    d = CollapseConfig()
    lines = ["# Collapse: the default command (smollm2-135m)", "",
             f"`llmcompress collapse smollm2-135m --target-layers N --method gelaco|drop-search` with the default spec "
             f"({d.calib_tokens} calibration / {d.val_tokens} validation tokens, population {d.population}, {d.generations} generations, "
             f"walk {d.refine_steps}/{d.refine_screen_blocks}/{d.refine_top}, {d.tune_steps} tuning steps, fitness_dtype {d.fitness_dtype}); "
             f"ShortGPT from the gelaco run's baselines. Perplexity: first {args.ppl_tokens} tokens of WikiText-2 test and "
             f"{args.shakespeare_tokens} of tinyshakespeare valid, seq-len 512. {os.cpu_count()} CPU cores, load average {load0:.1f} at start "
             f"(shared machine); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Search: "
             + ("NSGA-II over every layer count (`--front`), then the walk and tuning at N." if args.front else "single budget (GA at N).") , "",
             f"Dense: {dense[0]:.2f} / {dense[1]:.2f}.", "",
             "| method | layers | WikiText-2 ppl | tinyshakespeare ppl | KL val | wall s | evals/s | changes |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {m} | {n} | {w:.2f} | {t:.2f} | {kv:.3f} | {s:.0f} | {e:.3f} | {c} |" for m, n, w, t, kv, s, e, c in rows]
    text = "\n".join(lines) + "\n"
    args.default_out.write_text(text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib-tokens", type=int, default=None, help="default: the library's default spec (CollapseConfig)")
    ap.add_argument("--val-tokens", type=int, default=None)
    ap.add_argument("--population", type=int, default=None)
    ap.add_argument("--generations", type=int, default=None)
    ap.add_argument("--refine-steps", type=int, default=4, help="refinement moves per phase and budget after each search (0: off)")
    ap.add_argument("--refine-screen-blocks", type=int, default=4)
    ap.add_argument("--refine-top", type=int, default=4)
    ap.add_argument("--tune-steps", type=int, default=48, help="gelaco: Adam steps tuning the merge coefficients of each refined solution (0: off)")
    ap.add_argument("--tune-lr", type=float, default=0.05)
    ap.add_argument("--ppl-tokens", type=int, default=32768)
    ap.add_argument("--shakespeare-tokens", type=int, default=8192)
    ap.add_argument("--speed-sample", type=int, default=None, help="candidates timed (default 8; --speed: 24)")
    ap.add_argument("--out", type=Path, default=Path("bench/RESULTS-collapse.md"))
    ap.add_argument("--speed", action="store_true", help="only measure evaluations/s, one speed-up at a time (bench/RESULTS-collapse-speed.md)")
    ap.add_argument("--speed-out", type=Path, default=Path("bench/RESULTS-collapse-speed.md"))
    ap.add_argument("--default-command", action="store_true", help="run the default command at --budgets (bench/RESULTS-collapse-default.md)")
    ap.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    ap.add_argument("--methods", nargs="+", default=["drop-search", "gelaco"], choices=["drop-search", "gelaco"],
                    help="--default-command: the searches to run (ShortGPT comes with gelaco's baselines)")
    ap.add_argument("--default-out", type=Path, default=Path("bench/RESULTS-collapse-default.md"))
    ap.add_argument("--front", action="store_true", help="--default-command: search the whole front (NSGA-II), then walk and tune at each budget")
    args = ap.parse_args()
    if args.default_command:
        return default_main(args)
    if args.speed:
        args.speed_sample = args.speed_sample or 24
        return speed_main(args)
    from llmcompress.collapse.config import CollapseConfig as _C

    d = _C()
    args.calib_tokens = args.calib_tokens or d.calib_tokens
    args.val_tokens = args.val_tokens or d.val_tokens
    args.population = args.population or d.population
    args.generations = args.generations or d.generations
    args.speed_sample = args.speed_sample or 8

    import tempfile

    from llmcompress.collapse import baselines as B
    from llmcompress.collapse.config import CollapseConfig
    from llmcompress.collapse.export import build_model
    from llmcompress.collapse.fitness import prepare
    from llmcompress.collapse.refine import refine
    from llmcompress.collapse.search import make_space, run_search, select_by_validation
    from llmcompress.collapse.tune import tune
    from llmcompress.eval.perplexity import perplexity
    from llmcompress.io.load import load_model

    t_all = time.perf_counter()
    load0 = os.getloadavg()[0]
    lm = load_model("smollm2-135m")
    cfg = CollapseConfig(calib_tokens=args.calib_tokens, val_tokens=args.val_tokens, population=args.population,
                         generations=args.generations, min_layers=min(BUDGETS))
    ev = prepare(cfg, lm)
    import atexit

    atexit.register(ev.close)  # states spilled to a temp dir (1.1 GB at 16,384 validation tokens) go on any exit but SIGKILL
    scores = B.shortgpt_scores(ev)
    found = {"shortgpt": {n: B.shortgpt(ev, n, scores) for n in BUDGETS}}
    laco_path = B.laco(ev, min(BUDGETS), threshold=cfg.laco_threshold, n_blocks=cfg.laco_blocks)
    found["laco"] = {n: laco_path[n] for n in BUDGETS if n in laco_path}
    seeds = list(found["shortgpt"].values()) + list(found["laco"].values())
    wall, wall_search, walks, tunings, tune_wall = {}, {}, {}, {}, 0.0
    for method in ("drop-search", "gelaco"):
        mcfg = dataclasses.replace(cfg, method=method)
        ms = [s for s in seeds if method == "gelaco" or all(a == 0.0 for g in s.alphas for t in g for a in t)]
        if method == "gelaco":  # drop-only candidates are part of gelaco's space: it starts where drop-search ended
            ms = [c for c in found.get("drop-search", {}).values() if c not in ms] + ms
        t0 = time.perf_counter()
        ev.archive.clear()  # each method selects only among what its own search (and its seeds) evaluated
        for c in ms:
            ev.evaluate(c)
        with tempfile.TemporaryDirectory() as d:
            run_search(mcfg, ev, ms, Path(d), model_id="smollm2-135m")
        picks = {c.n_layers: c for c, _, _ in select_by_validation(ev, min(BUDGETS), max(BUDGETS))}
        t_search = time.perf_counter() - t0
        if args.refine_steps > 0:  # the library's refinement at each reported budget (pipeline: the saved counts)
            space = make_space(mcfg, ev.n_layers, ms)
            for n in BUDGETS:
                if n in picks:
                    res = refine(ev, space, picks[n], steps=args.refine_steps, screen_blocks=args.refine_screen_blocks,
                                 top=args.refine_top, on_step=lambda r, m=method: print(m, r, flush=True))
                    walks[(method, n)] = (len(res.trajectory) - 1, res.local_optimum)
                    picks[n] = res.best
        wall[method] = time.perf_counter() - t0
        wall_search[method] = t_search
        found[method] = {n: picks[n] for n in BUDGETS if n in picks}
        if method == "gelaco":  # speed measured on what the gelaco search actually evaluated (a seeded sample)
            import random

            pool = sorted((c for c in ev.archive.values() if c.first_changed() is not None), key=lambda c: c.key)
            sample = random.Random(0).sample(pool, min(args.speed_sample, len(pool)))
            first = [c.groups[c.first_changed()][0] for c in sample]
            speed = {
                "prefix states + cached reference": evals_per_second(ev, sample, True, True),
                "cached reference only (candidate from layer 0)": evals_per_second(ev, sample, False, True),
                "no cache (original and candidate rerun)": evals_per_second(ev, sample, False, False),
            }
            if args.tune_steps > 0:  # the library's coefficient tuning of each refined solution (after the speed sample)
                t1 = time.perf_counter()
                for n in BUDGETS:
                    if n in found[method]:
                        res = tune(ev, found[method][n], steps=args.tune_steps, lr=args.tune_lr)
                        tunings[n] = (found[method][n], res)
                        found[method][n] = res.best
                        print("tuned", n, res.fitness_val_start, "->", res.fitness_val_tuned, res.accepted, flush=True)
                tune_wall = time.perf_counter() - t1

    def ppl(model):
        w = perplexity(model, lm.tokenizer, "wikitext2", seq_len=512, max_tokens=args.ppl_tokens)["ppl"]
        s = perplexity(model, lm.tokenizer, "tinyshakespeare", split="valid", seq_len=512, max_tokens=args.shakespeare_tokens)["ppl"]
        return w, s

    rows = [("dense", 30, *ppl(lm.model), 0.0, 0.0, "original")]
    for method, per in found.items():
        for n in BUDGETS:
            if method == "gelaco" and n in tunings and tunings[n][1].tuned != tunings[n][0]:
                c = tunings[n][0]  # the walk's solution before tuning, to show what tuning adds
                rows.append(("gelaco before tuning", n, *ppl(build_model(lm.model, c)), ev.evaluate(c).kl, ev.evaluate(c, "val").kl, c.describe()))
            if n in per:
                c = per[n]
                rows.append((method, n, *ppl(build_model(lm.model, c)), ev.evaluate(c).kl, ev.evaluate(c, "val").kl, c.describe()))
    total = time.perf_counter() - t_all
    lines = [
        "# Collapse benchmark (smollm2-135m, 30 layers)",
        "",
        f"Settings: calibration {args.calib_tokens} tokens / validation {args.val_tokens} tokens of detokenized WikiText-2 valid "
        f"(seq 256, disjoint blocks); population {args.population}, generations {args.generations}, NSGA-II over 18..29 layers; "
        f"perplexity on the first {args.ppl_tokens} tokens of WikiText-2 raw test and {args.shakespeare_tokens} tokens of "
        f"tinyshakespeare valid, seq-len 512. After each search, the solution at each budget is refined by up to "
        f"{args.refine_steps} moves per phase (swaps, then for gelaco swaps + coefficient changes; screen {args.refine_screen_blocks} calibration blocks, top {args.refine_top} in full; "
        f"the walk's best point on validation is reported); then gelaco's merge coefficients are tuned by {args.tune_steps} Adam steps "
        f"(lr {args.tune_lr}) on the calibration KL within [0, 1], kept where the validation fitness drops. gelaco's population is seeded with ShortGPT's, LaCo's and drop-search's "
        f"final solutions (drop-only candidates are part of its space), so its time adds to drop-search's. {os.cpu_count()} CPU cores, load average at start {load0:.1f}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| method | layers | WikiText-2 ppl | tinyshakespeare ppl | KL calib | KL val | changes |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    lines += [f"| {m} | {n} | {w:.2f} | {s:.2f} | {kc:.3f} | {kv:.3f} | {d} |" for m, n, w, s, kc, kv, d in rows]
    lines += ["", "Search wall time (search + refinement): " + ", ".join(f"{k} {v:.0f} s ({wall_search[k]:.0f} s + {v - wall_search[k]:.0f} s)" for k, v in wall.items()),
              f"gelaco coefficient tuning: {tune_wall:.0f} s for {len(tunings)} solutions; validation fitness before -> after: " + ", ".join(f"{n}: {r.fitness_val_start:.3f} -> {r.fitness_val_tuned:.3f} ({'kept' if r.accepted else 'rejected'})" for n, (_, r) in tunings.items()),
              "Refinement moves per budget: " + ", ".join(f"{m} {n}: {k}{' (local optimum)' if lo else ''}" for (m, n), (k, lo) in walks.items()),
              f"Fitness evaluations per second on {len(first)} candidates sampled from the gelaco search "
              f"(first changed layer: {sorted(first)}):",
              *[f"- {k}: {v:.3f}/s ({v / speed['no cache (original and candidate rerun)']:.2f}x of no cache)" for k, v in speed.items()],
              f"- prefix states alone: {speed['prefix states + cached reference'] / speed['cached reference only (candidate from layer 0)']:.2f}x",
              f"Total benchmark time: {total:.0f} s", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
