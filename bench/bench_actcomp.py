"""Activation compression benchmark (issue 21): memory and step time of smollm2-135m training, healing quality.

(a) memory: end-to-end training of smollm2-135m (decoder layers trained with AdamW, embeddings/head frozen as
    in `distill --mode e2e`; next-token cross-entropy on WikiText-2 valid; bf16 autocast, fp32 weights) for
    --steps steps at --batch x --seq, one fresh subprocess per arm (so peak RSS is the arm's own): no
    compression, r = d/4, d/8, d/16 (a fraction of each linear input's width) and auto (--act-budget).
    Reports saved-for-backward bytes by category (exact, from the pack path), peak RSS, step time, and
    where the peak goes (weights, gradients, AdamW state, decoder-layer saves, logits/softmax/loss saves).
(b) quality: `llmcompress distill smollm2-135m --keep-layers 22 --select bi --mode e2e --ce-weight 1
    --precision bf16 --lr 5e-4` with and without --act-rank, then WikiText-2 test and tinyshakespeare
    (held-out last 10%) perplexity of each student.

    LLMCOMPRESS_DATA_DIR=../shared/data python bench/bench_actcomp.py --memory --batch 4 --seq 512 \
        --arms none,d/8,none+cce,d/8+cce,d/8+cce+co
    LLMCOMPRESS_DATA_DIR=../shared/data python bench/bench_actcomp.py --quality --train-tokens 16384
    python bench/bench_actcomp.py          # rewrite RESULTS-actcomp.md from the JSON alone

Writes bench/RESULTS-actcomp.json and bench/RESULTS-actcomp.md (after every memory arm): an arm replaces the
same arm of the same batch x seq x steps setting; other arms and settings are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = {"none": None, "d/4": 0.25, "d/8": 0.125, "d/16": 0.0625, "auto": "auto"}
FLAGS = ("cce", "co")  # arm suffixes: +cce chunked cross-entropy (loss.py), +co co-compression with FactoredStep (optim.py)


def parse_arm(arm: str) -> tuple[object, set[str]]:
    """'d/8+cce+co' -> (0.125, {'cce', 'co'})."""
    base, *flags = arm.split("+")
    if base not in ARMS or not set(flags) <= set(FLAGS) or ("co" in flags and ARMS[base] is None):
        raise SystemExit(f"bad arm {arm!r}: one of {list(ARMS)} with optional +cce, +co (co needs a rank)")
    return ARMS[base], set(flags)
MIB = 1 << 20


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def run_arm(arm: str, batch: int, seq: int, steps: int, budget: float, threads: int) -> dict:
    """One arm in this (fresh) process: returns its figures."""
    import torch

    torch.set_num_threads(threads)
    from llmcompress.actcomp.layer import compress_activations, training
    from llmcompress.actcomp.loss import causal_lm_loss
    from llmcompress.actcomp.optim import FactoredStep
    from llmcompress.data.blocks import calibration_blocks
    from llmcompress.io.adapters import get_adapter
    from llmcompress.io.load import load_model

    rss_start = current_rss_mib()
    lm = load_model("smollm2-135m", dtype=torch.float32)
    model = lm.model
    blocks, _ = calibration_blocks(lm.tokenizer, "wikitext2", split="valid", seq_len=seq, n_blocks=batch * steps, seed=0)
    rss_loaded = current_rss_mib()
    model.requires_grad_(False)
    layers = get_adapter(model).decoder_layers(model)
    params = [p for p in layers.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=5e-4)
    model.train()
    times, losses = [], []
    rank, flags = parse_arm(arm)
    ctx = (compress_activations(model, rank, budget=budget, seed=0, co_compress=True) if "co" in flags
           else training(model, rank, budget=budget, seed=0))
    dense_peak = None
    with ctx as ac:
        fs = FactoredStep(opt, ac) if "co" in flags else None
        for step in range(steps):
            ac.set_step(step)
            ids = blocks[step * batch : (step + 1) * batch]
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if "cce" in flags:
                    loss = causal_lm_loss(model, ids)
                else:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if fs is not None:
                fs.clip_grad_norm_(1.0)
                fs.step()
                fs.zero_grad()
            else:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            del loss
        saved = ac.counter.summary()
        auto = getattr(ac, "auto_ranks", None)
        if fs is not None:
            dense_peak = fs.peak_dense_grad_bytes
    n_all = sum(p.numel() * p.element_size() for p in model.parameters())
    n_train = sum(p.numel() * p.element_size() for p in params)
    return {
        "arm": arm, "batch": batch, "seq": seq, "steps": steps, "threads": threads, "losses": losses,
        "step_s": times, "step_s_mean_after_first": sum(times[1:]) / max(1, len(times) - 1),
        "peak_rss_mib": rss_mib(), "rss_start_mib": rss_start, "rss_loaded_mib": rss_loaded,
        "weights_bytes": n_all, "grad_bytes": n_train, "adamw_state_bytes": 2 * n_train, **saved,
        "auto_ranks": auto, "vocab": model.config.vocab_size, "factored_peak_dense_grad_bytes": dense_peak,
        "load_avg": os.getloadavg(),
    }


def setting(batch: int, seq: int, steps: int) -> str:
    """The key of a memory run's settings in the JSON: arms are only compared within one setting."""
    return f"{batch}x{seq}, {steps} steps"


def memory_runs(res: dict) -> dict:
    """res["memory"] as {setting: {arm: figures}} (an older file kept one setting's arms directly)."""
    mem = res.get("memory") or {}
    if mem and all("arm" in r for r in mem.values()):
        a = next(iter(mem.values()))
        mem = {setting(a["batch"], a["seq"], a["steps"]): mem}
    res["memory"] = mem
    return mem


def memory(args, res: dict, save) -> None:
    """Run each arm in a fresh subprocess; its figures replace the same arm's of the same setting in `res`,
    other arms and settings are kept, and `save(res)` runs after every arm (a stopped run keeps what finished)."""
    runs = memory_runs(res).setdefault(setting(args.batch, args.seq, args.steps), {})
    for arm in args.arms.split(","):
        parse_arm(arm)
        cmd = [sys.executable, __file__, "--arm", arm, "--batch", str(args.batch), "--seq", str(args.seq),
               "--steps", str(args.steps), "--budget", str(args.budget), "--threads", str(args.threads)]
        print("running", " ".join(cmd), flush=True)
        env = dict(os.environ, LLMCOMPRESS_PROGRESS="0", PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        t0 = time.strftime("%H:%M", time.gmtime())
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"arm {arm} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["ran"] = f"{time.strftime('%Y-%m-%d', time.gmtime())} {t0}-{time.strftime('%H:%M', time.gmtime())} UTC"
        runs[arm] = r
        save(res)
        print(f"  {arm}: peak RSS {r['peak_rss_mib']:.0f} MiB, saved {r['saved_total_bytes'] / MIB:.0f} MiB "
              f"(linear inputs {r['saved_linear_input_bytes'] / MIB:.0f}), step {r['step_s_mean_after_first']:.1f}s, "
              f"losses {[round(x, 4) for x in r['losses']]}, load {r['load_avg']}", flush=True)


def quality(args) -> dict:
    """Healing runs through the CLI, then tinyshakespeare perplexity of each student."""
    import torch

    torch.set_num_threads(args.threads)
    from llmcompress.eval.perplexity import perplexity
    from llmcompress.io.load import load_model

    res = {}
    work = Path(args.work)
    for arm, flags in (("none", []), (args.quality_arm, ["--act-rank", *args.quality_arm.split()])):
        key = "none" if not flags else " ".join(flags)
        out = work / ("heal-" + ("none" if not flags else args.quality_arm.replace(" ", "_").replace("-", "")))
        cmd = [sys.executable, "-m", "llmcompress", "distill", "smollm2-135m", "--keep-layers", "22", "--select", "bi",
               "--mode", "e2e", "--ce-weight", "1", "--precision", "bf16", "--lr", "5e-4", "--train-tokens", str(args.train_tokens),
               "--batch-size", str(args.heal_batch), "--seq-len", str(args.heal_seq), "--eval-tokens", str(args.eval_tokens),
               "--threads", str(args.threads), "--out", str(out), "--overwrite", *flags]
        if arm != "none":
            cmd += ["--act-budget", str(args.budget)]
        print("running", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, LLMCOMPRESS_PROGRESS="0"))
        if proc.returncode != 0:
            raise SystemExit(f"healing {key} failed:\n{proc.stderr[-3000:]}")
        m = json.loads((out / "metrics.json").read_text())
        lm = load_model(str(out / "student"), dtype=torch.float32)
        shakes = perplexity(lm.model, lm.tokenizer, "tinyshakespeare", seq_len=512, max_tokens=args.eval_tokens)["ppl"]
        res[key] = {"command": " ".join(cmd[2:]), "wall_s": round(time.perf_counter() - t0, 1), "wikitext2_ppl": m.get("ppl/wikitext2"),
                    "wikitext2_ppl_before": m.get("student_before/ppl/wikitext2"), "tinyshakespeare_ppl": shakes,
                    "peak_rss_mib": m.get("peak_rss_mb"), "train_wall_s": m.get("train_wall_s"), "activations": m.get("activations")}
        print(f"  {key}: wikitext2 {m.get('ppl/wikitext2'):.2f}, tinyshakespeare {shakes:.2f}, peak RSS {m.get('peak_rss_mb'):.0f} MiB", flush=True)
    return res


def _load(r: dict) -> str:
    return f"{r['load_avg'][0]:.1f}" if r.get("load_avg") else "9-11 (BENCHMARKS.md)"


def _dec(r: dict) -> int:
    return sum(r[f"saved_{k}_bytes"] for k in ("linear_input", "weight_copy", "decoder_other"))


# (what it buys, from arm, to arm): each component's share of the peak, read off two arms of one setting
STEPS_OF = [("chunked CE (loss.py)", "none", "none+cce"), ("sketch r = d/8, stock loss", "none", "d/8"),
            ("sketch r = d/8, on top of chunked CE", "none+cce", "d/8+cce"),
            ("co-compression (FactoredStep AdamW), on top of d/8 + chunked CE", "d/8+cce", "d/8+cce+co"),
            ("all three", "none", "d/8+cce+co")]


def render(res: dict) -> str:
    lines = ["# Activation compression (issue 21)", "",
             "Written by `bench/bench_actcomp.py` from `RESULTS-actcomp.json` (run it with no --memory/--quality to rewrite "
             "this file alone). Peak RSS and saved bytes do not depend on the machine's load; step times do, so each arm "
             "shows the 1-minute load average at its end (2-core machine, 1 torch thread per arm).", ""]
    for mem in memory_runs(dict(res)).values():
        lines += render_memory(mem)
    return render_quality(res, lines)


def render_memory(mem: dict) -> list[str]:
    if not mem:
        return []
    base = mem.get("none")
    a = next(iter(mem.values()))
    lines = [f"## Memory: smollm2-135m training, batch {a['batch']} x {a['seq']}, {a['steps']} steps, bf16 autocast, "
             f"{a['threads']} thread(s), fresh process per arm", "",
             "Arms: r = d/k sketches every linear input at a k-th of its width; +cce: chunked cross-entropy (no tokens x vocabulary "
             "logits); +co: co-compression, AdamW stepped from the factored weight gradients one linear at a time. "
             "Loss at step i is on batch i before its update (same batches in every arm; step 1 is the untouched model).", "",
             "| arm | ran (UTC) | saved linear inputs (MiB) | saved in decoder layers (MiB) | saved total (MiB) | peak RSS (MiB) "
             "| step (s, mean after the first) | load at end | loss per step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, r in mem.items():
        dec = _dec(r)
        rl = ("", "", "", "")
        if base and arm != "none":
            rl = (f" ({base['saved_linear_input_bytes'] / max(1, r['saved_linear_input_bytes']):.1f}x smaller)",
                  f" ({100 * (1 - dec / _dec(base)):.0f}% less)", f" ({100 * (r['peak_rss_mib'] / base['peak_rss_mib'] - 1):+.0f}%)",
                  f" ({r['step_s_mean_after_first'] / base['step_s_mean_after_first']:.2f}x)")
        ran = r.get("ran", "2026-12-04, older code")
        lines.append(f"| {arm} | {ran} | {r['saved_linear_input_bytes'] / MIB:,.0f}{rl[0]} | {dec / MIB:,.0f}{rl[1]} | {r['saved_total_bytes'] / MIB:,.0f} "
                     f"| {r['peak_rss_mib']:,.0f}{rl[2]} | {r['step_s_mean_after_first']:.1f}{rl[3]} | {_load(r)} "
                     f"| {', '.join(f'{x:.4f}' for x in r['losses'])} |")
    parts = [(what, mem[x], mem[y]) for what, x, y in STEPS_OF if x in mem and y in mem]
    if parts:
        lines += ["", "What each component buys (peak RSS and saved bytes, from one arm to the other):", "",
                  "| component | arms | peak RSS (MiB) | saved total (MiB) |", "|---|---|---|---|"]
        for what, x, y in parts:
            d = y["peak_rss_mib"] - x["peak_rss_mib"]
            lines.append(f"| {what} | {x['arm']} -> {y['arm']} | {d:+,.0f} ({100 * d / x['peak_rss_mib']:+.1f}%) "
                         f"| {(y['saved_total_bytes'] - x['saved_total_bytes']) / MIB:+,.0f} |")
    co = [r for r in mem.values() if r.get("factored_peak_dense_grad_bytes") is not None]
    for r in co:
        lines += ["", f"{r['arm']}: dense weight gradients alive at once at most {r['factored_peak_dense_grad_bytes'] / MIB:,.1f} MiB "
                  f"(one linear's), against {r['grad_bytes'] / MIB:,.0f} MiB of decoder-layer gradients in the dense arms."]
    if base:
        lines += ["", "Where the peak goes (no compression; MiB):", "",
                  "| part | MiB |", "|---|---|",
                  f"| process before loading (python, torch) | {base['rss_start_mib']:,.0f} |",
                  f"| model loaded + data (RSS after load) | {base['rss_loaded_mib'] - base['rss_start_mib']:,.0f} (weights {base['weights_bytes'] / MIB:,.0f}) |",
                  f"| gradients (decoder layers, fp32) | {base['grad_bytes'] / MIB:,.0f} |",
                  f"| AdamW state (2 x fp32) | {base['adamw_state_bytes'] / MIB:,.0f} |",
                  f"| saved in decoder layers: linear inputs | {base['saved_linear_input_bytes'] / MIB:,.0f} |",
                  f"| saved in decoder layers: bf16 weight copies (autocast) | {base['saved_weight_copy_bytes'] / MIB:,.0f} |",
                  f"| saved in decoder layers: norms, attention, SiLU, products | {base['saved_decoder_other_bytes'] / MIB:,.0f} |",
                  f"| saved outside: embeddings, final norm, logits/log-softmax/loss | {base['saved_outside_bytes'] / MIB:,.0f} |"]
        rest = base["peak_rss_mib"] - base["rss_loaded_mib"] - (base["grad_bytes"] + base["adamw_state_bytes"] + base["saved_total_bytes"]) / MIB
        lines.append(f"| rest (transients of backward: logits' fp32 copy and gradient, activation gradients; allocator) | {rest:,.0f} |")
    lines += ["", *goals(mem), ""]
    return lines


def goals(mem: dict) -> list[str]:
    """The issue's memory goals, met or missed, on this setting's arms (step time only where both arms exist)."""
    base, out = mem.get("none"), []
    if not base:
        return out
    a = base
    where = f"at batch {a['batch']} x {a['seq']}"
    for arm in ("d/8", "d/8+cce", "d/8+cce+co"):
        r = mem.get(arm)
        if r is None:
            continue
        lin = base["saved_linear_input_bytes"] / max(1, r["saved_linear_input_bytes"])
        dec = 1 - _dec(r) / _dec(base)
        rss = 1 - r["peak_rss_mib"] / base["peak_rss_mib"]
        out.append(f"- {arm} {where}: linear-input saved bytes {lin:.1f}x smaller (goal >= 4x: {'met' if lin >= 4 else 'MISSED'}); "
                   f"decoder-layer saved bytes {100 * dec:.0f}% smaller (goal >= 30%: {'met' if dec >= 0.30 else 'MISSED'}); "
                   f"peak RSS {100 * rss:.0f}% lower (goal >= 15% at 8 x 512: {'met' if rss >= 0.15 else 'MISSED'}"
                   f"{'' if a['batch'] == 8 else ', measured at this batch instead'}); "
                   f"step time {r['step_s_mean_after_first'] / base['step_s_mean_after_first']:.2f}x (goal <= 1.15x; load {_load(r)} against "
                   f"{_load(base)}: {'met' if r['step_s_mean_after_first'] <= 1.15 * base['step_s_mean_after_first'] else 'MISSED'} at that load).")
    return out


def render_quality(res: dict, lines: list[str]) -> str:
    q = res.get("quality")
    if q:
        lines += ["", "## Quality: healing the 22-layer Block-Influence student", "",
                  "| arm | WikiText-2 ppl | tinyshakespeare ppl | peak RSS (MiB) | training wall (s) |", "|---|---|---|---|---|"]
        base = q.get("none")
        for k, r in q.items():
            rel = ""
            if base and k != "none":
                rel = (f" ({r['wikitext2_ppl'] / base['wikitext2_ppl']:.3f}x)", f" ({r['tinyshakespeare_ppl'] / base['tinyshakespeare_ppl']:.3f}x)")
            rl = rel or ("", "")
            lines.append(f"| {k} | {r['wikitext2_ppl']:.2f}{rl[0]} | {r['tinyshakespeare_ppl']:.2f}{rl[1]} | {r['peak_rss_mib']:,.0f} | {r['train_wall_s']} |")
        lines += ["", "Commands: " + "; ".join(f"`{r['command']}`" for r in q.values())]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--arm", help="internal: run one memory arm in this process and print its JSON")
    ap.add_argument("--arms", default="none,d/4,d/8,d/16,auto")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train-tokens", type=int, default=16384)
    ap.add_argument("--heal-batch", type=int, default=2)
    ap.add_argument("--heal-seq", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--quality-arm", default="auto", help="--act-rank value of the compressed healing run")
    ap.add_argument("--work", default="/tmp/bench-actcomp")
    ap.add_argument("--out", default=str(HERE / "RESULTS-actcomp"))
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.batch, args.seq, args.steps, args.budget, args.threads)))
        return
    path = Path(args.out + ".json")
    res = json.loads(path.read_text()) if path.is_file() else {}
    from llmcompress.io.atomic import write_json, write_text

    def save(res: dict) -> None:
        write_json(path, res)
        write_text(Path(args.out + ".md"), render(res))

    if args.memory:
        memory(args, res, save)
    if args.quality:
        res["quality"] = quality(args)
        res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    save(res)
    print(render(res))


if __name__ == "__main__":
    main()
