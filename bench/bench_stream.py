"""Benchmark: layer streaming (io/stream.py) against the model in memory, on a ~1.7B LLaMA-shaped model.

Run: .venv/bin/python bench/bench_stream.py [--work /work/tmp/bench-stream] [--arms eval-mem,eval-stream,...]

The model is built from config (hidden 2048, 32 layers, MLP 5632, 16 heads / 4 KV heads, tied embeddings,
the SmolLM2 tokenizer's vocabulary of 49,152) with random weights, saved once as bf16 safetensors (~3.4 GB)
under --work; its quality is meaningless, its memory and time are real. Three computations, each streamed
(one decoder layer read from disk at a time) and in memory (the whole model loaded), all in float32 (the
CPU's compute dtype, `--dtype auto`):

* eval: perplexity (next-token NLL) of --eval-tokens tokens of WikiText-2 test, windows of 256;
* shortgpt: ShortGPT Block Influence of every layer on --calib-tokens calibration tokens;
* gptq: GPTQ 4-bit (groups of 128, asymmetric, act-order) of every decoder linear from --gptq-blocks blocks
  of 256 tokens; the integers go to disk layer by layer in both arms and their digests are compared;
* gelaco: a small seeded gelaco search (collapse/fitness.py `prepare`, `run_search`, `select_by_validation`:
  references, ShortGPT seed, --gelaco-population individuals for --gelaco-generations generations, the pick at
  --gelaco-target layers re-ranked on validation) on --gelaco-tokens calibration and as many validation tokens;
  streamed, every candidate's groups are built from source layers read from disk (collapse/stream.py). The
  pick and its fitness are compared. No baselines' LaCo, walk, tuning, report or checkpoint (the CLI's extras);
* distill: layer-wise distillation (`distill.engine.distill`, as `llmcompress distill --keep-layers
  --distill-keep --select bi --max-memory 0` streamed) of --distill-tokens WikiText-2 valid tokens: Block
  Influence, the teacher feature cache, both phases and the saved student; the training losses of the two arms
  are compared (they agree to float rounding, not bit for bit).

Each arm runs in its own process, one after the other (peak RSS = the process's VmHWM, absolute: the
runtime included). Results: --work/results.json and bench/RESULTS-stream.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ARMS = ["eval-stream", "eval-mem", "shortgpt-stream", "shortgpt-mem", "gptq-stream", "gptq-mem", "gelaco-stream", "gelaco-mem",
        "distill-stream", "distill-mem"]
SEQ = 256


def status(key: str) -> int:
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(key + ":")) * 1024


def make_model(path: Path) -> None:
    """The ~1.7B model with random weights, as bf16 safetensors, with the SmolLM2 tokenizer."""
    import torch
    import transformers

    from llmcompress.io.load import converted_alias_dir, load_model

    tok_dir = converted_alias_dir("smollm2-135m")
    if tok_dir is None:
        load_model("smollm2-135m")
        tok_dir = converted_alias_dir("smollm2-135m")
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=32,
                                   num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True,
                                   max_position_embeddings=2048, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)


def _blocks(path: Path, source: str, split: str, n_tokens: int, seed: int = 0):
    from transformers import AutoTokenizer

    from llmcompress.data import calibration_blocks
    from llmcompress.eval.perplexity import perplexity_blocks

    tok = AutoTokenizer.from_pretrained(str(path))
    if source == "eval":
        return perplexity_blocks(tok, "wikitext2", seq_len=SEQ, max_tokens=n_tokens)
    blocks, _ = calibration_blocks(tok, "wikitext2", split="valid", seq_len=SEQ, n_blocks=max(1, n_tokens // SEQ), seed=seed)
    return blocks


def _sink(out: Path, digest):
    """Writes each layer's integers to out/layer-NN.safetensors (q as uint8) and feeds a digest."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)

    def sink(i, qweights):
        tensors = {}
        for fqn in sorted(qweights):
            qw = qweights[fqn]
            tensors[f"{fqn}.q"] = qw.q.to(torch.uint8)
            tensors[f"{fqn}.scale"] = qw.scale.to(torch.float16)
            tensors[f"{fqn}.zero"] = qw.zero.to(torch.uint8)
            for t in (tensors[f"{fqn}.q"], tensors[f"{fqn}.scale"], tensors[f"{fqn}.zero"]):
                digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        save_file(tensors, str(out / f"layer-{i:02d}.safetensors"))

    return sink


def run_arm(arm: str, path: Path, work: Path, args) -> dict:
    """One arm in this process; returns its figures."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from llmcompress.io.stream import LayerRunner

    what, mode = arm.rsplit("-", 1)
    if what == "distill":
        return _distill(path, work / f"distill-{mode}", mode == "stream", args)
    n_tokens = {"eval": args.eval_tokens, "shortgpt": args.calib_tokens, "gptq": args.gptq_blocks * SEQ, "gelaco": args.gelaco_tokens}[what]
    blocks = _blocks(path, "eval" if what == "eval" else "calib", "", n_tokens)
    base = status("VmRSS")
    t0 = time.perf_counter()
    if mode == "stream":
        runner = LayerRunner.open(path, dtype=torch.float32, batch=args.batch)
    else:
        from llmcompress.io.load import load_model

        model = load_model(str(path), dtype=torch.float32).model
        runner = LayerRunner(model, batch=args.batch)
    t_load = time.perf_counter() - t0
    out: dict = {"arm": arm, "tokens": int(blocks.numel())}
    if what == "gelaco":
        out.update(_gelaco(runner, path, work / f"gelaco-{mode}", args))
    elif what == "eval":
        import math

        if mode == "stream":
            from llmcompress.io.stream import streamed_nll

            nll, n = streamed_nll(runner, blocks)
        else:
            from llmcompress.eval.perplexity import nll_of_blocks

            nll, n = nll_of_blocks(runner.model, blocks, batch_size=args.batch)
        out["ppl"] = math.exp(nll / n)
    elif what == "shortgpt":
        if mode == "stream":
            from llmcompress.io.stream import block_influence_layerwise

            scores = block_influence_layerwise(runner, blocks)
        else:  # what collapse does: every boundary state from one forward, then Block Influence
            from llmcompress.collapse.fitness import block_influence
            from llmcompress.io.forward import boundary_states

            states, _ = boundary_states(runner.model, blocks)
            scores = block_influence(states)
            del states
        out["block_influence"] = scores
    else:
        from llmcompress.quant.gptq import gptq_layerwise_, gptq_model_
        from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig

        plan = MixedPrecisionPlan()
        n_layers = runner.model.config.num_hidden_layers
        if args.gptq_layers and args.gptq_layers < n_layers:  # the first N layers only, in both arms
            runner.model.config.num_hidden_layers = n_layers = args.gptq_layers
        layers = "|".join(str(i) for i in range(n_layers))
        plan[rf"re:.*\.layers\.({layers})\..*"] = QuantConfig(bits=4, group_size=128, method="gptq")
        plan["_default"] = None
        digest = hashlib.sha256()
        sink = _sink(work / f"ints-{mode}", digest)
        if mode == "stream":
            gptq_layerwise_(runner, plan, blocks, act_order=True, sink=sink)
        else:
            gptq_model_(runner.model, plan, blocks, act_order=True, sink=sink)
        out["ints_sha256"] = digest.hexdigest()
        out["layers"] = n_layers
    out.update(wall_s=time.perf_counter() - t0, load_s=t_load, peak_rss_bytes=status("VmHWM"), base_rss_bytes=base,
               loadavg_1min_end=os.getloadavg()[0])
    return out


def _distill(path: Path, out_dir: Path, streamed: bool, args) -> dict:
    """Layer-wise distill of the 1.7B model, streamed (--max-memory 0) or in memory; the whole run is timed."""
    import shutil

    from llmcompress.distill import DistillConfig
    from llmcompress.distill.engine import distill

    shutil.rmtree(out_dir, ignore_errors=True)
    cfg = DistillConfig(teacher=str(path), keep_layers=args.distill_keep, select="bi", train_tokens=args.distill_tokens,
                        data="wikitext2", data_split="valid", seq_len=SEQ, batch_size=args.batch, eval_tokens=0,
                        cache_dir=str(out_dir) + "-cache")
    base = status("VmRSS")
    t0 = time.perf_counter()
    res = distill(cfg, out_dir, max_memory=0 if streamed else None)
    recs = [json.loads(x) for x in (out_dir / "train_log.jsonl").read_text().splitlines()]
    shutil.rmtree(str(out_dir) + "-cache", ignore_errors=True)
    m = res.metrics
    return {"arm": f"distill-{'stream' if streamed else 'mem'}", "tokens": args.distill_tokens, "wall_s": time.perf_counter() - t0,
            "load_s": 0.0, "peak_rss_bytes": status("VmHWM"), "base_rss_bytes": base, "loadavg_1min_end": os.getloadavg()[0],
            "streamed": m["streamed"], "keep": [s["sources"][0] for s in res.layer_map], "losses": [r["loss"] for r in recs],
            "cache_s": m.get("cache_s"), "phase1_s": m.get("phase1_s"), "phase2_s": m.get("phase2_s"),
            "student_bytes_on_disk": m.get("student_bytes_on_disk")}


def _gelaco(runner, path: Path, out_dir: Path, args) -> dict:
    """The small gelaco search over `runner` (streamed or in memory): its pick, fitness and evaluations."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from llmcompress.collapse.baselines import shortgpt
    from llmcompress.collapse.config import CollapseConfig
    from llmcompress.collapse.fitness import prepare
    from llmcompress.collapse.search import run_search, select_by_validation
    from llmcompress.runtime import seed_everything

    cfg = CollapseConfig(model=str(path), pareto=False, target_layers=args.gelaco_target, seq_len=SEQ, calib_tokens=args.gelaco_tokens,
                         val_tokens=args.gelaco_tokens, population=args.gelaco_population, generations=args.gelaco_generations,
                         refine_steps=0, tune_steps=0, baselines=["shortgpt"], batch_blocks=args.batch, fitness_dtype="float32",
                         prefix_cache_gb=args.gelaco_prefix_gb)
    seed_everything(cfg.seed)
    lm = SimpleNamespace(model=runner.model, tokenizer=AutoTokenizer.from_pretrained(str(path)))
    ev = prepare(cfg, lm, runner=runner if runner.streamed else None)
    try:
        seeds = [shortgpt(ev, cfg.target_layers)]
        run_search(cfg, ev, seeds, out_dir, model_id=str(path))
        (cand, f, v), = select_by_validation(ev, cfg.target_layers, cfg.target_layers)
        return {"pick": cand.describe(), "fitness_calib": f.fitness, "fitness_val": v.fitness, "evaluations": ev.stats.evaluations,
                "search": f"target {cfg.target_layers} layers, population {cfg.population}, {cfg.generations} generation(s), "
                          f"prefix cache {cfg.prefix_cache_gb:g} GiB"}
    finally:
        ev.close()


def write_md(results: dict, ckpt_bytes: int, md: Path, cmd: str) -> None:
    lines = [
        "# Layer streaming vs in memory (issue 20)",
        "",
        f"Command: `{cmd}`  ",
        f"Date: {time.strftime('%Y-%m-%d')}; machine: 2 CPU cores and 24 GiB shared with other jobs (1-minute load average "
        "at each arm's end in the table): wall times are noisy; peak RSS is not.",
        "",
        f"Model: LLaMA-shaped, hidden 2048, 32 layers, MLP 5632, 16/4 heads, tied embeddings, vocab 49,152, "
        f"random weights, bf16 safetensors of {ckpt_bytes / 1e9:.2f} GB; compute in float32 (the CPU's --dtype auto).",
        "",
        "| computation | tokens | arm | peak RSS (GB) | / checkpoint | wall (s) | of which loading (s) | streamed/in-memory wall "
        "| load avg | result |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for what in ("eval", "shortgpt", "gptq", "gelaco", "distill"):
        mem, st = results.get(f"{what}-mem"), results.get(f"{what}-stream")
        for r in (st, mem):
            if r is None:
                continue
            if what == "eval":
                res = f"ppl {r['ppl']:.4f}"
            elif what == "shortgpt":
                res = "BI " + ", ".join(f"{x:.4f}" for x in r["block_influence"][:3]) + ", ..."
            elif what == "gelaco":
                res = (f"{r['search']}, {r['evaluations']} evaluations: pick {r['pick']}, fitness calib {r['fitness_calib']:.6f} "
                       f"/ val {r['fitness_val']:.6f}")
            elif what == "distill":
                other = mem if r is st else st
                diff = (max(abs(a - b) / abs(b) for a, b in zip(r["losses"], other["losses"]))
                        if other and len(other["losses"]) == len(r["losses"]) else float("nan"))
                res = (f"{len(r['keep'])} layers kept, {len(r['losses'])} steps, last loss {r['losses'][-1]:.5f} (max rel. diff "
                       f"to the other arm {diff:.1e}); cache {r['cache_s']:.0f} s, phases {r['phase1_s']:.0f} + {r['phase2_s']:.0f} s")
            else:
                res = f"{r.get('layers', 32)} layers, ints sha256 {r['ints_sha256'][:12]}"
            ratio = f"{st['wall_s'] / mem['wall_s']:.2f}" if (st and mem and r is st) else ""
            lines.append(f"| {what} | {r['tokens']:,} | {r['arm'].rsplit('-', 1)[1]} | {r['peak_rss_bytes'] / 1e9:.2f} | "
                         f"{r['peak_rss_bytes'] / ckpt_bytes:.2f} | {r['wall_s']:.0f} | {r['load_s']:.0f} | {ratio} | "
                         f"{r.get('loadavg_1min_end', float('nan')):.1f} | {res} |")
    md.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/work/tmp/bench-stream"))
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--gptq-blocks", type=int, default=2)
    ap.add_argument("--gptq-layers", type=int, default=0,
                    help="GPTQ over the first N decoder layers only (0: all); the in-memory arm still loads every layer")
    ap.add_argument("--gelaco-tokens", type=int, default=512, help="gelaco: calibration tokens (and as many validation tokens)")
    ap.add_argument("--gelaco-population", type=int, default=4)
    ap.add_argument("--gelaco-generations", type=int, default=1)
    ap.add_argument("--gelaco-prefix-gb", type=float, default=1.0, help="gelaco: prefix_cache_gb (candidates' own boundary states)")
    ap.add_argument("--gelaco-target", type=int, default=28, help="gelaco: layers to keep (single-budget search)")
    ap.add_argument("--distill-keep", type=int, default=24, help="distill: decoder layers the student keeps")
    ap.add_argument("--distill-tokens", type=int, default=2048, help="distill: training tokens (--train-tokens)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--make", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--md", type=Path, default=Path(__file__).with_name("RESULTS-stream.md"))
    args = ap.parse_args()
    path = args.work / "model-1.7b-bf16"
    if args.make:  # child process: build the model (its memory is freed with the process)
        make_model(path)
        return
    if args.arm:  # child process: one arm
        print(json.dumps(run_arm(args.arm, path, args.work, args)))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    if not path.is_dir():
        print(f"building the model at {path} ...", flush=True)
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--make", "--work", str(args.work)], check=True)
    ckpt = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    res_path = args.work / "results.json"
    results = json.loads(res_path.read_text()) if res_path.is_file() else {}
    for arm in [a for a in args.arms.split(",") if a]:
        if arm in results:
            continue
        print(f"arm {arm} ...", flush=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--arm", arm, "--work", str(args.work),
               "--eval-tokens", str(args.eval_tokens), "--calib-tokens", str(args.calib_tokens),
               "--gptq-blocks", str(args.gptq_blocks), "--gptq-layers", str(args.gptq_layers), "--batch", str(args.batch),
               "--gelaco-tokens", str(args.gelaco_tokens), "--gelaco-population", str(args.gelaco_population),
               "--gelaco-generations", str(args.gelaco_generations), "--gelaco-target", str(args.gelaco_target),
               "--gelaco-prefix-gb", str(args.gelaco_prefix_gb), "--distill-keep", str(args.distill_keep),
               "--distill-tokens", str(args.distill_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"arm {arm} failed")
        results[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[arm]
        print(f"  {arm}: peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB ({r['peak_rss_bytes'] / ckpt:.2f}x checkpoint), "
              f"wall {r['wall_s']:.0f}s", flush=True)
        res_path.write_text(json.dumps(results, indent=1))
    write_md(results, ckpt, args.md, "python bench/bench_stream.py " + " ".join(sys.argv[1:]))
    print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
