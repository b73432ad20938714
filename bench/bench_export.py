"""Benchmark: GGUF exports of smollm2-135m -- file bytes and torch perplexity of the weights each file holds.

Run: .venv/bin/python bench/bench_export.py [--tokens 32768] [--only NAME,...] [--work runs/bench-export]
Rows: the shipped Q4_1 GGUF; our dense BF16 GGUF; RTN and GPTQ 4-bit at groups of 64 (asymmetric, Q4_1
blocks) and at groups of 32 symmetric (Q4_0); RTN 8-bit (Q8_0); and, as a check of the caveat, RTN
4-bit asymmetric at groups of 32, the shipped file's block layout. (Measured: it does *not* reproduce the
shipped weights: Q4_1 stores a float minimum per block, our quantizer an integer zero point, z = round(-min/s),
so the source's grid is shifted by up to s/2 and every weight is re-rounded.) Perplexity: WikiText-2
raw test, first --tokens tokens, windows of 512, computed in torch (float32) on exactly the weights
written (quantized linears dequantized, embedding Q8_0-dequantized, other tensors rounded to the file's
dtype). Each row is cached in --work/NAME.json (rerun to resume); the GGUF files stay in --work for the
llama.cpp runtime benchmark. Results: bench/RESULTS-export.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch

VARIANTS = [
    # name, options (None = the shipped file / dense bf16), note
    ("shipped-q4_1", None, "the GGUF smollm2-135m ships in (Q4_1 linears, Q8_0 embedding); torch ppl = the source weights"),
    ("rtn4-asym-g64", {"bits": 4, "group_size": 64, "sym": False}, "Q4_1 blocks, pairs share parameters"),
    ("gptq4-asym-g64", {"bits": 4, "group_size": 64, "sym": False, "quant": "gptq"}, "Q4_1 blocks, pairs share parameters"),
    ("rtn4-sym-g32", {"bits": 4, "group_size": 32, "sym": True}, "Q4_0"),
    ("gptq4-sym-g32", {"bits": 4, "group_size": 32, "sym": True, "quant": "gptq"}, "Q4_0"),
    ("rtn8-sym-g32", {"bits": 8, "group_size": 32, "sym": True}, "Q8_0"),
    ("dense-bf16", {"bits": 16}, "no quantization, BF16 (+F32 norms)"),
    ("rtn4-asym-g32", {"bits": 4, "group_size": 32, "sym": False}, "the shipped block layout; integer zero points re-round the shipped grid"),
]


def run_variant(lm, name, opts, work: Path, tokens: int) -> dict:
    from llmcompress.eval.perplexity import perplexity
    from llmcompress.export.api import ExportOptions, export_loaded
    from llmcompress.io.load import ALIASES, alias_gguf_path

    t0 = time.perf_counter()
    if opts is None:  # the shipped file: its weights are the loaded model's
        path = alias_gguf_path(ALIASES["smollm2-135m"])
        model, row = lm.model, {"path": str(path), "bytes": path.stat().st_size, "tensor_types": {"Q4_1": 210, "Q8_0": 1, "F32": 61}}
    else:
        model = copy.deepcopy(lm.model)
        sub = copy.copy(lm)
        sub.model = model
        o = ExportOptions(**opts)
        o.validate("gguf")
        row = export_loaded(sub, "gguf", work / f"{name}.gguf", o, overwrite=True)
        if o.bits >= 16:  # the file holds the float tensors in bf16: evaluate those
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() >= 2:
                        p.copy_(p.to(torch.bfloat16).float())
    export_s = time.perf_counter() - t0
    ppl = perplexity(model, lm.tokenizer, "wikitext2", seq_len=512, max_tokens=tokens)
    return {"name": name, "bytes": row["bytes"], "tensor_types": row.get("tensor_types"), "path": row["path"],
            "ppl_torch": ppl["ppl"], "tokens_scored": ppl["tokens_scored"], "export_s": round(export_s, 1),
            "calibration": row.get("calibration")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--only", default="")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-export"))
    ap.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS-export.md"))
    args = ap.parse_args()
    from llmcompress.io.load import load_model

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    args.work.mkdir(parents=True, exist_ok=True)
    lm = load_model("smollm2-135m")
    only = {s for s in args.only.split(",") if s}
    rows = []
    for name, opts, note in VARIANTS:
        cache = args.work / f"{name}.json"
        if cache.is_file() and json.loads(cache.read_text()).get("tokens") == args.tokens:
            r = json.loads(cache.read_text())
        elif only and name not in only:
            continue
        else:
            print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
            r = {**run_variant(lm, name, opts, args.work, args.tokens), "tokens": args.tokens, "note": note}
            cache.write_text(json.dumps(r, indent=2, default=str))
            print(f"  {r['bytes'] / 1e6:.1f} MB, ppl {r['ppl_torch']:.3f} ({r['export_s']} s export)", flush=True)
        rows.append(r)
    shipped = next((r for r in rows if r["name"] == "shipped-q4_1"), None)
    bf16 = next((r for r in rows if r["name"] == "dense-bf16"), None)
    lines = [f"# GGUF exports of smollm2-135m ({time.strftime('%Y-%m-%d')})", "",
             f"Command: `python bench/bench_export.py --tokens {args.tokens}`. Torch perplexity on WikiText-2 raw test "
             f"(first {args.tokens} tokens, windows of 512) of exactly the weights each file holds. "
             "The source weights are dequantized Q4_1 (asymmetric blocks of 32 with a float minimum); 4-bit methods are "
             "compared at groups of 64 (asymmetric) or 32 symmetric, where no method can return the source grid.", "",
             "| file | bytes (MB) | x bf16 | x shipped | tensor types | torch ppl | note |", "|---|---:|---:|---:|---|---:|---|"]
    for r in rows:
        xb = f"{r['bytes'] / bf16['bytes']:.3f}" if bf16 else "—"
        xs = f"{r['bytes'] / shipped['bytes']:.3f}" if shipped else "—"
        lines.append(f"| {r['name']} | {r['bytes'] / 1e6:.1f} | {xb} | {xs} | {r.get('tensor_types')} | {r['ppl_torch']:.3f} | {r['note']} |")
    by = {r["name"]: r for r in rows}
    pairs = [("gptq4-asym-g64", "rtn4-asym-g64"), ("gptq4-sym-g32", "rtn4-sym-g32")]
    ratios = [f"{g} / {n}: {by[g]['ppl_torch'] / by[n]['ppl_torch']:.3f}" for g, n in pairs if g in by and n in by]
    if ratios:
        lines += ["", "GPTQ vs RTN perplexity at the same format and bytes (goal <= 0.92): " + "; ".join(ratios) + "."]
    calib = next((r["calibration"] for r in rows if r.get("calibration")), None)
    if calib:
        lines += ["", f"GPTQ calibration (as `nas`): {calib}."]
    args.results.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
