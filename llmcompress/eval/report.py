"""Evaluate one model (perplexity, lm-eval tasks, size, speed) and render several side by side."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmcompress.spec import MAX_BATCH, MAX_SEQ, MAX_TOKENS, Int, Real, check_ranges


@dataclass
class EvalSpec:
    """What `evaluate` measures."""

    ppl: list[str] = field(default_factory=lambda: ["wikitext2"])
    seq_len: int = 512
    max_tokens: int | None = 16384
    batch_size: int = 4
    tasks: list[str] = field(default_factory=list)
    limit: float | None = None
    include_tasks: str | None = None
    speed: bool = True

    def validate(self) -> None:
        """Raise UserError on out-of-range numbers (before any model loads)."""
        check_ranges(self, RANGES)

    def to_dict(self) -> dict:
        return asdict(self)


RANGES = {
    "seq_len": Int("--seq-len", 2, MAX_SEQ),
    "max_tokens": Int("--max-tokens", 0, MAX_TOKENS, note="0 scores all tokens; e.g. --max-tokens 16384"),
    "batch_size": Int("--batch-size", 1, MAX_BATCH, note="e.g. --batch-size 4"),
    "limit": Real("--limit", 0.0, 1e9, lo_open=True, note="a count of samples per task, or a fraction below 1"),
}


def evaluate(lm, spec: EvalSpec, path: str | None = None) -> dict:
    """Measure a LoadedModel. Returns a flat, JSON-ready dict."""
    from llmcompress.eval.perplexity import check_seq_len, perplexity
    from llmcompress.eval.speed import measure_speed, peak_rss_mb, size_info

    check_seq_len(lm.model, spec.seq_len)
    t0 = time.perf_counter()
    row: dict = {"model": lm.source, "family": lm.adapter.family, **size_info(lm.model, path)}
    for data in spec.ppl:
        t_data = time.perf_counter()
        r = perplexity(lm.model, lm.tokenizer, data, seq_len=spec.seq_len, max_tokens=spec.max_tokens, batch_size=spec.batch_size)
        row[f"ppl/{data}"] = r["ppl"]
        row[f"ppl/{data}/tokens_scored"] = r["tokens_scored"]
        row[f"ppl/{data}/tokens_per_s"] = r["tokens"] / max(1e-9, time.perf_counter() - t_data)
    if spec.tasks:
        from llmcompress.eval.lmeval import run_lm_eval

        results = run_lm_eval(lm.model, lm.tokenizer, spec.tasks, limit=spec.limit, include_path=spec.include_tasks)
        for task, metrics in results.items():
            for k, v in metrics.items():
                row[f"{task}/{k}"] = v
    if spec.speed:
        row.update(measure_speed(lm.model))
    row["peak_rss_mb"] = peak_rss_mb()
    row["eval_seconds"] = time.perf_counter() - t0
    return row


_ORDER = ["layers", "parameters", "disk_bytes"]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 10 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(metric names, one column per model) for a side-by-side table."""
    keys: list[str] = []
    for k in _ORDER + [k for r in rows for k in r]:
        if k not in keys and k not in ("model", "device", "threads", "param_bytes"):
            keys.append(k)
    return keys, [[_fmt(r.get(k)) for r in rows] for k in keys]


def to_markdown(rows: list[dict], spec: EvalSpec, title: str = "llmcompress eval") -> str:
    keys, cells = table_rows(rows)
    lines = [f"# {title}", "", f"Settings: `{spec.to_dict()}`", ""]
    lines.append("| metric | " + " | ".join(str(r["model"]) for r in rows) + " |")
    lines.append("|---|" + "---|" * len(rows))
    for k, vals in zip(keys, cells):
        lines.append(f"| {k} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, rows: list[dict], spec: EvalSpec) -> None:
    from llmcompress.io.atomic import atomic_dir, write_json, write_text

    with atomic_dir(Path(out), overwrite=True) as tmp:
        write_json(tmp / "report.json", {"spec": spec.to_dict(), "models": rows})
        write_text(tmp / "report.md", to_markdown(rows, spec))
