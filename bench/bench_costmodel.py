"""Cost models of `nas` against decode time measured in llama.cpp, on GGUF exports of smollm2-135m (issue 18).

    python bench/bench_costmodel.py [--work runs/bench-costmodel] [--threads 2] [--repeats 5] [--only NAME,...] [--export-only]

Exports 15 configurations (uniform Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/BF16; mixes per linear kind; a per-layer mix;
fewer layers by dropping the last layers but the final one, as `collapse` drops them), RTN-quantized
(decode time does not depend on the values), Q8_0 embedding when any linear is quantized, as `export` writes
them. Measures each file's decode seconds per token in llama-cpp-python (prompt 32, then 32 tokens one at a
time; every round runs every file once, rotated order, median of --repeats rounds after a warm-up;
OpenMP wait policy as set in the environment: unset on an idle machine, OMP_WAIT_POLICY=PASSIVE on a shared one;
the figures of 2026-12-05/06 in BENCHMARKS.md were taken with PASSIVE) and compares three cost models against it, side by side:

    measured  nas/measured.py: probe GGUFs timed in llama.cpp on this machine, NNLS per (type, shape); absolute
    analytic  nas/cost.py: bytes per decoded token, relative to dense; scaled by the measured BF16 file's time
    lut       nas/cost.py: torch F.linear timings (bit-width blind), relative to dense; scaled the same way

MAPE and Spearman rank correlation of each. Results: bench/RESULTS-costmodel.md (+ WORK/results.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench_runtime import (  # (OMP_WAIT_POLICY=default there means unset)
    ROOT,
    cpu_model,
    load_average,
)

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def uniform(t):
    return lambda layer, kind, n: t


def by_kind(attn, mlp, down=None):
    return lambda layer, kind, n: (down if down and kind == "mlp.down_proj" else attn if kind in ATTN else mlp)


# name -> (layers kept (None = all 30), type of (layer, kind, n_layers))
CONFIGS = {
    "uniform-Q4_0": (None, uniform("Q4_0")),
    "uniform-Q4_1": (None, uniform("Q4_1")),
    "uniform-Q5_0": (None, uniform("Q5_0")),
    "uniform-Q5_1": (None, uniform("Q5_1")),
    "uniform-Q8_0": (None, uniform("Q8_0")),
    "uniform-BF16": (None, uniform("BF16")),
    "attnQ8_0-mlpQ4_0": (None, by_kind("Q8_0", "Q4_0")),
    "attnQ4_0-mlpQ8_0": (None, by_kind("Q4_0", "Q8_0")),
    "attnBF16-mlpQ4_1": (None, by_kind("BF16", "Q4_1")),
    "attnQ5_1-mlpQ4_1": (None, by_kind("Q5_1", "Q4_1")),
    "downQ8_0-restQ4_0": (None, by_kind("Q4_0", "Q4_0", down="Q8_0")),
    "halfQ8_0-halfQ4_0": (None, lambda layer, kind, n: "Q8_0" if layer < n // 2 else "Q4_0"),
    "22layers-BF16": (22, uniform("BF16")),
    "22layers-Q8_0": (22, uniform("Q8_0")),
    "16layers-Q4_0": (16, uniform("Q4_0")),
}
BITS = {"Q4_0": (4, True), "Q4_1": (4, False), "Q5_0": (5, True), "Q5_1": (5, False), "Q8_0": (8, True), "BF16": (16, False)}


def kept(n_keep: int | None, total: int) -> list[int]:
    """Drop the last layers but the final one (collapse-like: late layers are the most redundant)."""
    if n_keep is None:
        return list(range(total))
    return list(range(n_keep - 1)) + [total - 1]


def export(lm, name: str, path: Path) -> dict:
    from llmcompress.export.api import quantize_embeddings_
    from llmcompress.export.gguf import write_gguf
    from llmcompress.io.surgery import keep_layers
    from llmcompress.quant.apply import quantize_model_
    from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig

    n_keep, type_of = CONFIGS[name]
    model = copy.deepcopy(lm.model)
    total = len(model.model.layers)
    keep = kept(n_keep, total)
    keep_layers(model, keep)
    plan, types = MixedPrecisionPlan(), {}
    for i in range(len(keep)):
        for kind in ATTN + MLP:
            t = type_of(i, kind, len(keep))
            types[f"{i}.{kind}"] = t
            bits, sym = BITS[t]
            if bits < 16:
                plan[f"model.layers.{i}.{kind}"] = QuantConfig(bits=bits, group_size=32, method="rtn", sym=sym)
    plan["_default"] = None
    qw = quantize_model_(model, plan, progress=False) if len(plan) > 1 else {}
    if qw:
        qw.update(quantize_embeddings_(model))
    r = write_gguf(model, path, qweights=qw, float_dtype="bfloat16", tokenizer=lm.tokenizer, name=name, overwrite=True)
    return {"path": str(path), "bytes": r["bytes"], "tensor_types": r["tensor_types"], "keep": keep, "types": types}


def arch_of(space, row: dict, total: int):
    from llmcompress.nas.space import Arch

    keep = [i in row["keep"] for i in range(total)]
    bits = [[0] * len(space.linears) for _ in range(total)]
    for new, old in enumerate(row["keep"]):
        for j, kind in enumerate(space.linears):
            bits[old][j] = space.bits.index(BITS[row["types"][f"{new}.{kind}"]][0])
    return Arch(keep, [len(space.widths) - 1] * total, bits)


def spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-costmodel")
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp threads (0: the cores)")
    ap.add_argument("--repeats", type=int, default=0, help="interleaved rounds (0: the table's, 7)")
    ap.add_argument("--stat", default="min", choices=["min", "median"], help="of the rounds (table and files alike)")
    ap.add_argument("--only", default="")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS-costmodel.md")
    ap.add_argument("--export-only", action="store_true", help="write the GGUFs and stop (run it niced, outside the timing lock)")
    ap.add_argument("--nas", default="", help="a `nas --cost-model measured --export gguf` run dir to quote (its arch.json)")
    args = ap.parse_args()
    import torch

    from llmcompress.io.load import load_model
    from llmcompress.nas import measured as M
    from llmcompress.nas.config import NasConfig
    from llmcompress.nas.cost import build_cost_models
    from llmcompress.nas.space import build_space
    from llmcompress.runtime import default_threads

    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    args.work.mkdir(parents=True, exist_ok=True)
    res_path = args.work / "results.json"
    res = json.loads(res_path.read_text()) if res_path.is_file() else {}
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    t0 = time.time()
    lm = load_model("smollm2-135m")
    if args.export_only:
        for n in names:
            if n not in res or not (args.work / f"{n}.gguf").is_file():
                res[n] = export(lm, n, args.work / f"{n}.gguf")
                res_path.write_text(json.dumps(res, indent=2))
                print(f"exported {n}: {res[n]['bytes'] / 1e6:.1f} MB", flush=True)
        return
    args.repeats = args.repeats or M.REPEATS
    table = M.measure_table(lm.model.config, lm.tokenizer, ftype="BF16", threads=threads, repeats=args.repeats, stat=args.stat)
    print(f"latency table: {len(table['probes'])} probes, fit error {table['fit_mape']:.1%} ({table['measured_at']})", flush=True)
    for n in names:
        path = args.work / f"{n}.gguf"
        if n not in res or not path.is_file():
            res[n] = export(lm, n, path)
            res_path.write_text(json.dumps(res, indent=2))
            print(f"exported {n}: {res[n]['bytes'] / 1e6:.1f} MB", flush=True)
    load_before = load_average()
    t_timing = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    llms = M.open_llms({n: Path(res[n]["path"]) for n in names}, threads, M.PROMPT + M.DECODE)
    samples = M.time_decode(llms, repeats=args.repeats)
    for llm in llms.values():
        llm.close()
    load_after = load_average()
    for n in names:
        res[n]["measured_s"] = M.summarize(samples[n], args.stat)
        res[n]["median_s"] = statistics.median(samples[n])
        res[n]["samples"] = samples[n]
    res_path.write_text(json.dumps(res, indent=2))

    cfg = NasConfig(bits=[4, 5, 8, 16], group_size=32, width_choices=[1.0], target_bits=8.0)
    space = build_space(lm.model, cfg)
    analytic = build_cost_models(lm.model, space, "analytic", M.PROMPT + M.DECODE)
    lut = build_cost_models(lm.model, space, "lut", M.PROMPT + M.DECODE)
    total = space.n_layers
    ref = res["uniform-BF16"]["measured_s"] if "uniform-BF16" in names else None
    for n in names:
        r = res[n]
        r["pred/measured"] = M.modeled_gguf(table, Path(r["path"]))
        a = arch_of(space, r, total)
        if ref:
            r["pred/analytic"] = analytic.metrics(a)["latency"] * ref
            r["pred/lut"] = lut.metrics(a)["latency"] * ref
    res_path.write_text(json.dumps(res, indent=2))
    models = ["measured"] + (["analytic", "lut"] if ref else [])
    meas = [res[n]["measured_s"] for n in names]
    summary = {}
    for m in models:
        pred = [res[n][f"pred/{m}"] for n in names]
        summary[m] = (statistics.mean(abs(p / t - 1) for p, t in zip(pred, meas)), spearman(pred, meas))
    lines = [f"# Cost models vs llama.cpp decode time, smollm2-135m ({time.strftime('%Y-%m-%d')})", "",
             f"Command: `python bench/bench_costmodel.py` ({time.time() - t0:.0f} s). Machine: {cpu_model()}, "
             f"{os.cpu_count()} cores, {threads} threads, llama-cpp-python {_version()}, OMP_WAIT_POLICY="
             f"{os.environ.get('OMP_WAIT_POLICY', 'default')}. Decode: prompt {M.PROMPT}, then {M.DECODE} tokens one at a time, "
             f"{args.stat} of {args.repeats} interleaved rounds (median in brackets); timed {t_timing}, load average {load_before} -> {load_after}.",
             f"Latency table (measured model): {len(table['probes'])} probe GGUFs of {table['key']['probe_layers']} and "
             f"{max(1, table['key']['probe_layers'] // 2)} layers (version {table['key']['version']}), timed {table['measured_at']} at load {table['load_average']}, "
             f"fit error on the probes {table['fit_mape']:.1%}. analytic and lut are relative to dense; scaled by the "
             "measured time of uniform-BF16.", "",
             "| config | layers | MB | measured ms/token | measured model | analytic | lut |", "|---|---:|---:|---:|---:|---:|---:|"]
    for n in names:
        r = res[n]
        cells = [f"{r[f'pred/{m}'] * 1e3:.2f} ({r[f'pred/{m}'] / r['measured_s'] - 1:+.1%})" for m in models]
        cells += ["-"] * (3 - len(cells))
        lines.append(f"| {n} | {len(r['keep'])} | {r['bytes'] / 1e6:.1f} | {r['measured_s'] * 1e3:.2f} ({r['median_s'] * 1e3:.1f}) | "
                     + " | ".join(cells) + " |")
    lines += ["", "| cost model | MAPE | Spearman |", "|---|---:|---:|"]
    lines += [f"| {m} | {summary[m][0]:.1%} | {summary[m][1]:.3f} |" for m in models]
    mape, rho = summary["measured"]
    lines += ["", f"Goal (measured model, >= 10 configurations): MAPE <= 15% and Spearman >= 0.9 over {len(names)}: "
              f"{'met' if mape <= 0.15 and rho >= 0.9 and len(names) >= 10 else 'MISSED'} ({mape:.1%}, {rho:.3f})."]
    if args.nas:
        a = json.loads((Path(args.nas) / "arch.json").read_text())
        rt = a.get("runtime_latency")
        if rt:
            lines += ["", f"`nas --cost-model measured --export gguf` ({args.nas}): modeled {rt['modeled_ms_per_token']:.2f} "
                      f"ms/token, measured {rt['measured_ms_per_token']:.2f} ({rt['error']:+.1%}, load {rt['load_average']})."]
    text = "\n".join(lines) + "\n"
    args.results.write_text(text)
    print(text)


def _version() -> str:
    import llama_cpp

    return llama_cpp.__version__


if __name__ == "__main__":
    sys.exit(main())
