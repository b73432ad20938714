"""report.md: teacher and student perplexity, parameters, wall time, peak memory (atomic write)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmcompress.distill.run import BEFORE_PPL, TEACHER_PPL
from llmcompress.eval.report import WIKITEXT2_PPL
from llmcompress.io.atomic import write_text
from llmcompress.table import fmt, markdown_table


def _fmt(v: Any) -> str:
    return fmt(v, ",.2f", none="not measured")


def render(cfg, metrics: dict[str, Any]) -> str:
    rows = [
        ("mode", metrics.get("mode")),
        ("teacher", cfg.teacher),
        ("student", cfg.student or f"{cfg.keep_layers} layers kept ({cfg.select.value})"),
        ("layers (teacher -> student)", f"{metrics.get('teacher_layers')} -> {metrics.get('student_layers')}"),
        ("parameters (teacher -> student)", f"{_fmt(metrics.get('teacher_parameters'))} -> {_fmt(metrics.get('student_parameters'))}"),
        ("student checkpoint on disk (bytes, dtype)", f"{_fmt(metrics.get('student_bytes_on_disk'))} ({metrics.get('student_dtype')})"),
        ("teacher in memory or streamed", "streamed layer by layer from disk (above --max-memory)" if metrics.get("streamed") else "in memory"),
        ("training data", metrics.get("data")),
        ("training tokens (budget / unique)", f"{_fmt(metrics.get('train_tokens'))} / {_fmt(metrics.get('unique_tokens'))}"),
        ("passes over the data (--epochs)", cfg.epochs),
        ("teacher perplexity", metrics.get(TEACHER_PPL)),
        ("student perplexity before", metrics.get(BEFORE_PPL)),
        ("student perplexity after", metrics.get(WIKITEXT2_PPL)),
        ("training wall time (s, without evaluation)", metrics.get("train_wall_s")),
        ("total wall time (s)", metrics.get("wall_s")),
        ("peak resident memory (MiB)", metrics.get("peak_rss_mb")),
    ]
    comm = metrics.get("grad_compress")
    if comm:
        rows.append(("data-parallel ranks, gradient exchange", f"{comm['world_size']}, {comm['grad_compress']}"))
        rows.append(("gradient bytes sent by rank 0 (all / weight matrices)", f"{_fmt(comm['comm_bytes'])} / {_fmt(comm['comm_matrix_bytes'])}"))
        if comm.get("final_rank") is not None:
            rows.append(("PowerSGD rank at the end (changes)", f"{comm['final_rank']} ({len(comm.get('rank_changes') or [])})"))
    for key, label in (("cache_s", "feature caching (s)"), ("phase1_s", "phase 1 (s)"), ("phase2_s", "phase 2 (s)"), ("e2e_s", "end-to-end steps (s)")):
        if key in metrics:
            rows.append((label, metrics[key]))
    act = metrics.get("activations")
    if act:
        mib = 1 << 20
        rank = act.get("act_rank")
        rows += [
            ("activation compression (--act-rank)", "off" if rank is None else (f"auto, budget {cfg.act_budget}" if rank == "auto" else rank)),
        ]
        if act.get("act_grad") == "factored":
            rows.append(("weight gradients (--act-grad factored)", f"{act.get('factored_weights', 0)} linears stepped from their factors, "
                         f"dense gradients alive at once at most {act.get('factored_peak_dense_grad_bytes', 0) / mib:,.2f} MiB"))
        rows += [
            ("saved-for-backward bytes per step, peak (MiB)", act.get("saved_total_bytes", 0) / mib),
            ("  of which linear inputs (MiB; uncompressed)", f"{act.get('saved_linear_input_bytes', 0) / mib:,.2f} "
             f"({act.get('saved_linear_input_uncompressed_bytes', 0) / mib:,.2f})"),
            ("  of which inside decoder layers (MiB)", sum(act.get(f"saved_{k}_bytes", 0) for k in ("linear_input", "weight_copy", "decoder_other")) / mib),
            ("training step time (s, mean)", act.get("step_s")),
        ]
    lines = ["# llmcompress distill report", "", *markdown_table(["", ""], [(k, _fmt(v)) for k, v in rows])]
    ppl = f"WikiText-2 raw test, first {cfg.eval_tokens} tokens, seq-len {cfg.eval_seq_len}"
    lines += ["", f"Perplexity: {ppl}. Peak memory: ru_maxrss of this process (includes loading the teacher)."]
    if act:
        lines += ["Saved-for-backward bytes: counted exactly in autograd's pack path (llmcompress/actcomp/counter.py), the "
                  "largest step of the training loops; without --act-rank the same count, for comparison."]
    if "order" in metrics:
        rank = {k: i for i, k in enumerate(metrics["order"])}
        lines += ["", "## Segments", "", *markdown_table(
            ["segment", "teacher layers", "student layers", "initial loss", "difficulty rank"],
            [[s["index"], f"{s['teacher_start']}..{s['teacher_end'] - 1}", f"{s['student_start']}..{s['student_end'] - 1}",
              f"{metrics['initial_losses'].get(str(s['index']), float('nan')):.4f}", rank.get(s["index"], "-")] for s in metrics["segments"]])]
    lines += ["", "Settings: " + ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items()), ""]
    return "\n".join(lines)


def write_report(out: Path, cfg, metrics: dict[str, Any]) -> Path:
    path = Path(out) / "report.md"
    write_text(path, render(cfg, metrics))
    return path
