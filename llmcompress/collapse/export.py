"""Outputs: collapsed models as checkpoints, pareto.json/csv/png, and report.md (all written atomically)."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from llmcompress.collapse.operator import collapse_group
from llmcompress.collapse.space import Candidate
from llmcompress.eval.report import NOTES, PIQA_ACC, SELF_PPL, WIKITEXT2_PPL
from llmcompress.io.adapters import get_adapter
from llmcompress.io.atomic import atomic_path, write_json, write_text
from llmcompress.io.surgery import replace_layers, shared_copy
from llmcompress.table import fmt, markdown_table

QUALITY = (WIKITEXT2_PPL, SELF_PPL, PIQA_ACC)  # the quality keys of a row (eval/report.py's vocabulary)


def build_model(model, cand: Candidate):
    """A new model whose decoder layers are the candidate's collapsed groups. It shares every tensor it does
    not change with `model` (kept layers, embeddings, head: no second full copy); merged layers are new."""
    new = shared_copy(model)
    adapter = get_adapter(new)
    layers = list(adapter.decoder_layers(new))
    built = [collapse_group([layers[i] for i in grp], cand.alpha_dicts(g), adapter.kind_of) for g, grp in enumerate(cand.groups)]
    replace_layers(new, built, [grp[0] for grp in cand.groups])
    return new.eval()


def solution_record(name: str, cand: Candidate, calib, val, **extra) -> dict:
    return {
        "name": name,
        "layers": cand.n_layers,
        "params": calib.params,
        "kl_calib": calib.kl,
        "kl_val": val.kl if val else None,
        "sim_calib": calib.sim,
        "fitness_calib": calib.fitness,
        "fitness_val": val.fitness if val else None,
        "changes": cand.describe(),
        "groups": [list(g) for g in cand.groups],
        "layer_map": cand.layer_map(),
        **extra,
    }


def knee(records: list[dict]) -> dict:
    """The knee of a front in (layers, validation fitness): farthest point from the line joining the extremes."""
    import numpy as np

    if len(records) <= 2:
        return min(records, key=lambda r: r["layers"]) if len(records) == 2 else records[0]
    pts = np.array([[r["layers"], r["fitness_val"]] for r in records], dtype=float)
    span = pts.max(0) - pts.min(0)
    span[span == 0] = 1.0
    p = (pts - pts.min(0)) / span
    a, b = p[p[:, 0].argmin()], p[p[:, 0].argmax()]
    u, v = b - a, p - a
    d = np.abs(u[0] * v[:, 1] - u[1] * v[:, 0]) / (np.linalg.norm(u) or 1.0)
    return records[int(d.argmax())]


def choose_to_save(records: list[dict], save: str) -> list[dict]:
    """knee | all | comma-separated layer counts (the closest solution at or above each count)."""
    from llmcompress.errors import UserError

    if not records:
        return []
    if save == "all":
        return list(records)
    if save == "knee":
        return [knee(records)]
    from llmcompress.collapse.config import CollapseConfig

    counts = CollapseConfig(save=save).save_counts()
    out = []
    for n in counts:
        at = [r for r in records if r["layers"] == n] or sorted([r for r in records if r["layers"] >= n], key=lambda r: r["layers"])[:1]
        if not at:
            raise UserError(f"no solution with {n} layers on the front", f"layer counts found: {sorted({r['layers'] for r in records})}")
        if at[0] not in out:
            out.append(at[0])
    return out


def write_front(out_dir: Path, records: list[dict], baselines: list[dict], meta: dict) -> None:
    """pareto.json (front + baselines + metadata) and pareto.csv."""
    write_json(out_dir / "pareto.json", {**meta, "front": records, "baselines": baselines})
    buf = io.StringIO()
    cols = ["name", "layers", "params", "kl_calib", "kl_val", "sim_calib", "fitness_calib", "fitness_val", *QUALITY, "changes"]
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in records + baselines:
        w.writerow(r)
    write_text(out_dir / "pareto.csv", buf.getvalue())


def plot_front(path: Path, records: list[dict], baselines: list[dict], title: str) -> None:
    """The front (layers vs KL, calibration and validation) with the baselines' points, Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rs = sorted(records, key=lambda r: r["layers"])
    if rs:
        ax.plot([r["layers"] for r in rs], [r["kl_calib"] for r in rs], "o-", label="front (calibration KL)")
        ax.plot([r["layers"] for r in rs], [r["kl_val"] for r in rs], "s--", label="front (validation KL)")
    markers = {"shortgpt": "^", "laco": "v", "drop-search": "x", "gelaco": "D"}
    for method in sorted({b["method"] for b in baselines}):
        pts = sorted((b for b in baselines if b["method"] == method), key=lambda b: b["layers"])
        ax.plot([b["layers"] for b in pts], [b["kl_val"] for b in pts], markers.get(method, "+"), ls=":", label=f"{method} (validation KL)")
    ax.set_xlabel("decoder layers")
    ax.set_ylabel("KL to the original (nats / token)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def save_solution(model, tokenizer, cand: Candidate, record: dict, out: Path, *, source: str, source_hash: str, config: dict, overwrite: bool,
                  dtype: str | None = None):
    """Write the collapsed model as a HF checkpoint with its layer map in the manifest."""
    from llmcompress.io.checkpoint import save_checkpoint

    new = build_model(model, cand)
    manifest = solution_manifest(cand, record, source=source, source_hash=source_hash, config=config)
    save_checkpoint(new, tokenizer, out, manifest=manifest, overwrite=overwrite, dtype=dtype)
    return new


def solution_manifest(cand: Candidate, record: dict, *, source: str, source_hash: str, config: dict) -> dict:
    """The llmcompress.json of a saved solution (before the checkpoint's closing fields): its layer map and metrics."""
    from llmcompress.io.checkpoint import build_manifest

    metrics = {k: record.get(k) for k in ("kl_calib", "kl_val", "sim_calib", *QUALITY) if record.get(k) is not None}
    return build_manifest(
        source=source,
        source_hash=source_hash,
        method=f"collapse/{record.get('method', config.get('method'))}",
        config=config,
        metrics=metrics,
        extra={"layer_map": cand.layer_map(), "original_layers": sum(len(g) for g in cand.groups)},
    )


HELD_OUT_SEED = 1_000_003  # added to the run's seed: held-out self text never shares a seed with calibration/validation


def eval_corpus_reachable() -> bool:
    """True when WikiText-2's test split is on this machine or the hub can be reached."""
    from llmcompress.data.sources import hub_reachable, local_file

    return local_file("wikitext2", "test") is not None or hub_reachable()


def held_out_self_blocks(model, tokenizer, *, eval_tokens: int, seq_len: int, seed: int):
    """Held-out evaluation text when no corpus is reachable: sequences sampled from the (dense) model with
    seed `seed + HELD_OUT_SEED`, so disjoint from the calibration and validation blocks (other seeds)."""
    from llmcompress.data.blocks import self_text_blocks

    seq = min(seq_len, eval_tokens)
    return self_text_blocks(model, tokenizer, seq, max(1, eval_tokens // seq), seed + HELD_OUT_SEED)


def quality(model, tokenizer, *, eval_tokens: int, seq_len: int, piqa_limit: int, ppl_blocks=None) -> dict:
    """WikiText-2 test perplexity `ppl/wikitext2` (or, given `ppl_blocks`, perplexity on those held-out self-text
    blocks: `ppl/self`) and PIQA accuracy `piqa/acc` (each skipped when its budget is 0), through
    `eval.report.measure_noted`: a measure whose data or lm-eval is unavailable becomes a line under `notes`
    (listed in the report), so the report keeps the search; any other error (a bug) propagates.
    """
    from llmcompress.eval.report import EvalSpec, measure_noted, wikitext2_spec

    out: dict = {}
    if eval_tokens > 0 and ppl_blocks is not None:
        import math

        from llmcompress.eval.perplexity import nll_of_blocks

        nll, n = nll_of_blocks(model, ppl_blocks, description="ppl held-out self text")
        out[SELF_PPL] = math.exp(nll / n)
    specs, notes = [], []
    if eval_tokens > 0 and ppl_blocks is None and tokenizer is not None:
        specs.append(wikitext2_spec(eval_tokens, min(seq_len, eval_tokens)))
    if piqa_limit > 0 and tokenizer is not None:  # lm-eval's default batch of 8
        specs.append(EvalSpec(ppl=[], tasks=["piqa"], limit=piqa_limit, batch_size=8, speed=False))
    for spec in specs:
        row = measure_noted(model, tokenizer, spec)
        out.update({k: row[k] for k in (WIKITEXT2_PPL, PIQA_ACC) if k in row})
        notes += row.get(NOTES, [])
    if notes:
        out[NOTES] = notes
    return out


STREAMED_PIQA_NOTE = "PIQA not measured: the model is streamed layer by layer (above --max-memory) and lm-eval needs it whole"
STREAMED_SELF_NOTE = ("perplexity not measured: WikiText-2 is not here, and held-out self text is sampled from the whole model, "
                      "which is streamed layer by layer (above --max-memory)")


def quality_streamed(runner, tokenizer, *, eval_tokens: int, seq_len: int, piqa_limit: int, self_text: bool = False) -> dict:
    """`quality` for a model streamed layer by layer: `runner` is an `io.stream.LayerRunner` (the dense model) or
    a `collapse.stream.CollapsedRunner` (a candidate, never built whole). WikiText-2 perplexity through
    `io.stream.streamed_nll` (the windows `wikitext2_spec` scores; missing data becomes a note, as in
    `quality`); PIQA and held-out self text, which need the whole model, become notes."""
    import math

    from llmcompress.eval.perplexity import perplexity_blocks
    from llmcompress.eval.report import UNAVAILABLE, unavailable_note, wikitext2_spec
    from llmcompress.io.stream import streamed_nll

    out: dict = {}
    notes: list[str] = []
    if eval_tokens > 0 and self_text:
        notes.append(STREAMED_SELF_NOTE)
    elif eval_tokens > 0 and tokenizer is not None:
        spec = wikitext2_spec(eval_tokens, min(seq_len, eval_tokens))
        try:
            blocks = perplexity_blocks(tokenizer, "wikitext2", seq_len=spec.seq_len, max_tokens=spec.max_tokens)
        except UNAVAILABLE as exc:
            notes.append(unavailable_note(f"perplexity on wikitext2 ({WIKITEXT2_PPL})", exc))
        else:
            nll, n = streamed_nll(runner, blocks, description="ppl wikitext2 (streamed)")
            out[WIKITEXT2_PPL] = math.exp(nll / n)
    if piqa_limit > 0 and tokenizer is not None:
        notes.append(STREAMED_PIQA_NOTE)
    if notes:
        out[NOTES] = notes
    return out


def _wikitext_protocol(meta: dict) -> str:
    seq = min(meta.get("eval_seq_len") or 0, meta.get("eval_tokens") or 0)
    return (f"WikiText-2 raw test, first {meta.get('eval_tokens')} tokens, non-overlapping windows of {seq} tokens "
            f"(stride {seq}), each window scored without context from the previous one")


def write_report(path: Path, rows: list[dict], meta: dict) -> None:
    """report.md: dense model, baselines and chosen solutions side by side."""
    lines = [
        f"# llmcompress collapse: {meta.get('model')}",
        "",
        f"- method: {meta.get('method')}; mode: {'pareto' if meta.get('pareto') else 'single'}; "
        f"population {meta.get('population')}, generations {meta.get('generations')}, seed {meta.get('seed')}",
        f"- calibration: {meta.get('calibration')}; validation: {meta.get('validation')} (never optimized on)",
        f"- search: {meta.get('evaluations')} fitness evaluations in {fmt(meta.get('search_seconds'), '.1f')} s "
        f"({fmt(meta.get('evals_per_s'), '.3f')} evals/s, prefix cache on)",
        *([f"- settings: {meta['settings']}"] if meta.get("settings") else []),
        *([f"- budget: {meta['budget']}"] if meta.get("budget") else []),
        f"- perplexity: {meta.get('ppl_protocol') or _wikitext_protocol(meta)}; "
        f"PIQA: {meta.get('piqa_note') or str(meta.get('piqa_limit')) + ' examples'}",
        "",
    ]
    self_text = meta.get("ppl_source") == "self"
    ppl_key = SELF_PPL if self_text else WIKITEXT2_PPL
    lines += markdown_table(
        ["model", "layers", "params", "KL calib", "KL val", "held-out self-text ppl" if self_text else "WikiText-2 ppl", "PIQA acc", "changes"],
        [[r["name"], r["layers"], f"{r['params'] / 1e6:.1f}M", fmt(r.get("kl_calib"), ".3f"), fmt(r.get("kl_val"), ".3f"),
          fmt(r.get(ppl_key), ".2f"), fmt(r.get(PIQA_ACC), ".3f"), r.get("changes", "")] for r in rows],
        align="lrrrrrrl",
    )
    saved = [r for r in rows if r.get("bytes_on_disk")]
    if saved:
        lines += ["", "Checkpoints on disk: " + "; ".join(
            f"{r['name']}: {r['bytes_on_disk'] / 1e6:.1f} MB ({r.get('dtype')}, {r['params'] / 1e6:.1f}M parameters)" for r in saved)]
    notes = sorted({n for r in rows for n in r.get(NOTES, ())})
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    write_text(path, "\n".join(lines) + "\n")
