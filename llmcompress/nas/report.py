"""report.md: dense and each searched/baseline result side by side."""

from __future__ import annotations

from pathlib import Path

from llmcompress.eval.report import WIKITEXT2_PPL
from llmcompress.table import fmt, markdown_table


def render(rows: list[dict], cfg, lut: dict | None, notes: list[str]) -> str:
    lines = [
        "# llmcompress nas report",
        "",
        f"Model `{cfg.model}`, cost model `{cfg.cost_model}`, targets {cfg.targets()}, bits {cfg.bits}, "
        f"train tokens {cfg.train_tokens} (seq {cfg.seq_len}), eval: WikiText-2 raw test, first {cfg.eval_tokens} tokens at {cfg.eval_seq_len}.",
        f"Every row's weights come from one {getattr(cfg, 'quant_method', 'rtn').upper()} quantizer"
        + (" (act-order, static groups)" if getattr(cfg, "quant_method", "rtn") == "gptq" and getattr(cfg, "gptq_act_order", False) else "")
        + ", computed once per bit width: the search scores the weights that are exported, and uniform differs from joint "
        "only by the plan.",
        "",
    ]
    lines += markdown_table(
        ["result", "layers", "MLP width (mean)", "avg bits", "size MB", "modeled latency", "ppl", "prefill tok/s", "decode tok/s"],
        [[r["name"], r.get("layers", "—"), fmt(r.get("mean_width"), ".0f"), fmt(r.get("avg_bits"), ".2f"), fmt(r.get("size_mb"), ".1f"),
          fmt(r.get("modeled_latency"), ".3f"), fmt(r.get(WIKITEXT2_PPL), ".2f"), fmt(r.get("prefill_tokens_per_s"), ".0f"),
          fmt(r.get("decode_tokens_per_s"), ".1f")] for r in rows])
    lines += ["", "Size MB is the cost model's size of the quantized weights (ints + float16 scales + zeros; embeddings and norms "
              "in float16); hf/ holds the dequantized weights, for evaluation; gguf/ and compressed-tensors/ (--export) are the "
              "deployable files.",
              "Modeled latency is relative to the dense float16 model under the chosen cost model; measured speeds run "
              "dequantized float32 weights on this CPU (no low-bit kernels), so they reflect structure only."]
    if lut:
        lines += ["", f"Latency table: dense decode {lut['t_full'] * 1e3:.1f} ms/token at context {lut['context_len']}, "
                      f"{lut['per_layer'] * 1e3:.2f} ms per layer, {lut['threads']} threads."]
    if notes:
        lines += ["", "Notes:", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def write_report(path: Path, rows, cfg, lut, notes) -> None:
    from llmcompress.io.atomic import write_text

    write_text(path, render(rows, cfg, lut, notes))
