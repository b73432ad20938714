"""Evaluate one model (perplexity, lm-eval tasks, size, speed) and render several side by side."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmcompress.errors import DataError, UserError
from llmcompress.spec import MAX_BATCH, MAX_COUNT, MAX_SEQ, MAX_TOKENS, Int, Real, check_ranges


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
    num_fewshot: int | None = None
    apply_chat_template: bool = False
    log_samples: bool = False

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
    "num_fewshot": Int("--num-fewshot", 0, MAX_COUNT, note="e.g. --num-fewshot 0"),
}


def evaluate(lm, spec: EvalSpec, path: str | None = None) -> dict:
    """Measure a LoadedModel. Returns a flat, JSON-ready dict."""
    from llmcompress.eval.perplexity import check_seq_len
    from llmcompress.eval.speed import peak_rss_mb, size_info

    check_seq_len(lm.model, spec.seq_len)
    t0 = time.perf_counter()
    row: dict = {"model": lm.source, "family": lm.adapter.family, **size_info(lm.model, path)}
    row.update(measure(lm.model, lm.tokenizer, spec, model_name=lm.source))
    row["peak_rss_mb"] = peak_rss_mb()
    row["eval_seconds"] = time.perf_counter() - t0
    return row


# ---------------------------------------------------------------- the metric vocabulary
# Every report and manifest names a measurement the same way: `ppl/<data>` for perplexity on a corpus
# (`wikitext2`, `tinyshakespeare`, a file; `self` for held-out text sampled from the dense model),
# `<task>/<metric>` for an lm-eval task metric (`piqa/acc`), `<role>/<key>` for a model other than the one
# the report is about (distill: `teacher/ppl/wikitext2`, `student_before/ppl/wikitext2`; the student's own keys
# are unprefixed), and `notes`: a list of one-line notes, e.g. a measure left out because its data is missing.

NOTES = "notes"
TEACHER, STUDENT_BEFORE = "teacher", "student_before"  # distill's roles


def ppl_key(data: str) -> str:
    """The key of perplexity on `data`: `ppl/<data>`."""
    return f"ppl/{data}"


def task_key(task: str, metric: str) -> str:
    """The key of an lm-eval task metric: `<task>/<metric>`."""
    return f"{task}/{metric}"


def role_key(role: str, key: str) -> str:
    """`key` measured on another model than the report's own: `<role>/<key>` (e.g. `teacher/ppl/wikitext2`)."""
    return f"{role}/{key}"


WIKITEXT2_PPL = ppl_key("wikitext2")  # the key `measure` gives WikiText-2 perplexity under
SELF_PPL = ppl_key("self")  # perplexity on held-out self text (collapse without a reachable corpus)
PIQA_ACC = task_key("piqa", "acc")


def measure(model, tokenizer, spec: EvalSpec, *, model_name: str = "model") -> dict:
    """The measurements of `spec` on a model in memory, the one evaluation path of `llmcompress eval` and of
    the engines' post-run reports: `ppl/<data>` (with tokens scored, windows, tokens/s) per corpus, lm-eval
    task metrics as `<task>/<metric>`, and the speed keys of `measure_speed`."""
    from llmcompress.eval.perplexity import perplexity

    row: dict = {}
    for data in spec.ppl:
        t_data = time.perf_counter()
        r = perplexity(model, tokenizer, data, seq_len=spec.seq_len, max_tokens=spec.max_tokens, batch_size=spec.batch_size)
        key = ppl_key(data)
        row[key] = r["ppl"]
        row[f"{key}/tokens_scored"] = r["tokens_scored"]
        row[f"{key}/windows"] = r["windows"]
        row[f"{key}/tokens_per_s"] = r["tokens"] / max(1e-9, time.perf_counter() - t_data)
    if spec.tasks:
        from llmcompress.eval.lmeval import run_lm_eval_full

        run = run_lm_eval_full(
            model, tokenizer, spec.tasks, limit=spec.limit, include_path=spec.include_tasks, batch_size=spec.batch_size,
            num_fewshot=spec.num_fewshot, apply_chat_template=spec.apply_chat_template, log_samples=spec.log_samples,
            model_name=model_name,
        )
        for task, metrics in run.metrics.items():
            for k, v in metrics.items():
                row[task_key(task, k)] = v
        row[LM_EVAL_KEY] = run  # lm-eval's own results; `write_report` saves them (popped before JSON)
    if spec.speed:
        from llmcompress.eval.speed import measure_speed

        row.update(measure_speed(model))
    return row


def wikitext2_spec(eval_tokens: int, seq_len: int) -> EvalSpec:
    """The engines' post-run perplexity: WikiText-2 raw test, the first `eval_tokens` tokens in windows of `seq_len`."""
    return EvalSpec(ppl=["wikitext2"], seq_len=seq_len, max_tokens=eval_tokens, speed=False)


def measure_noted(model, tokenizer, spec: EvalSpec, *, model_name: str = "model") -> dict:
    """`measure`, one part at a time (each corpus, then the lm-eval tasks, then speed), for the engines'
    post-run reports: a part that cannot run because its dataset or lm-eval is missing becomes a line under
    `notes` (what was not measured, the cause and how to fix it; said once per process on stderr) and the
    other parts are still measured. Any other error is a bug and propagates."""
    import dataclasses

    row: dict = {}
    notes: list[str] = []
    parts = [(f"perplexity on {data} ({ppl_key(data)})", dataclasses.replace(spec, ppl=[data], tasks=[], speed=False)) for data in spec.ppl]
    if spec.tasks:
        parts.append((f"lm-eval {', '.join(spec.tasks)}", dataclasses.replace(spec, ppl=[], speed=False)))
    if spec.speed:
        parts.append(("speed", dataclasses.replace(spec, ppl=[], tasks=[])))
    for what, part in parts:
        try:
            row.update(measure(model, tokenizer, part, model_name=model_name))
        except UNAVAILABLE as exc:
            notes.append(unavailable_note(what, exc))
    if notes:
        row[NOTES] = notes
    return row


UNAVAILABLE = (DataError, ModuleNotFoundError)  # what `measure_noted` turns into a note: missing data (DataError), a missing package
_SAID: set[str] = set()


def unavailable_note(what: str, exc: BaseException) -> str:
    """One line: `what` not measured, with the cause and its fix; said once per process on stderr."""
    import sys

    if isinstance(exc, UserError):
        cause = exc.one_line()
    elif isinstance(exc, ModuleNotFoundError):
        cause = f"the package {exc.name!r} is not installed (pip install {'lm-eval' if (exc.name or '').startswith('lm_eval') else exc.name})"
    else:
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    text = f"{what} not measured: {cause}"
    if text not in _SAID:
        _SAID.add(text)
        print(f"notice: {text}", file=sys.stderr)
    return text


def evaluate_streamed(spec_name: str, path, spec: EvalSpec, *, dtype=None, device="cpu") -> dict:
    """`evaluate` for a model streamed layer by layer from the safetensors directory `path` (a model larger
    than the memory budget): perplexity only; lm-eval tasks and speed need the whole model and are skipped,
    with a notice."""
    import sys

    from transformers import AutoTokenizer

    from llmcompress.eval.speed import peak_rss_mb
    from llmcompress.io.stream import LayerRunner, streamed_nll

    skipped = [what for what, asked in (("lm-eval tasks", bool(spec.tasks)), ("speed", spec.speed)) if asked]
    if skipped:
        print(f"notice: {spec_name} is streamed: {' and '.join(skipped)} skipped (they need the whole model in memory)", file=sys.stderr)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    runner = LayerRunner.open(path, dtype=dtype, device=device, batch=spec.batch_size)
    from llmcompress.eval.perplexity import check_seq_len, perplexity_blocks

    check_seq_len(runner.model, spec.seq_len)
    row: dict = {"model": spec_name, "family": runner.adapter.family, "layers": runner.n_layers,
                 "disk_bytes": sum(f.stat().st_size for f in Path(path).glob("*.safetensors")),
                 "streamed": True}
    try:
        for data in spec.ppl:
            t_data = time.perf_counter()
            blocks = perplexity_blocks(tok, data, seq_len=spec.seq_len, max_tokens=spec.max_tokens)
            nll, n = streamed_nll(runner, blocks, description=f"ppl {data} (streamed)")
            row[f"ppl/{data}"] = math.exp(nll / n)
            row[f"ppl/{data}/tokens_scored"] = n
            row[f"ppl/{data}/windows"] = int(blocks.shape[0])
            row[f"ppl/{data}/tokens_per_s"] = blocks.numel() / max(1e-9, time.perf_counter() - t_data)
    finally:
        runner.close()
    row["peak_rss_mb"] = peak_rss_mb()
    row["eval_seconds"] = time.perf_counter() - t0
    return row


_ORDER = ["layers", "parameters", "disk_bytes"]
LM_EVAL_KEY = "_lm_eval"


def _cell(r: dict, k: str) -> str:
    from llmcompress.table import fmt

    se = r.get(f"{k}_stderr")
    return f"{fmt(r.get(k), none='-')} ± {fmt(se, none='-')}" if isinstance(se, (int, float)) and r.get(k) is not None else fmt(r.get(k), none="-")


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(metric names, one column per model) for a side-by-side table; a metric with a stderr shows `value ± stderr`."""
    keys: list[str] = []
    for k in _ORDER + [k for r in rows for k in r]:
        if k not in keys and k not in ("model", "device", "threads", "param_bytes", LM_EVAL_KEY) and not k.endswith("_stderr"):
            keys.append(k)
    return keys, [[_cell(r, k) for r in rows] for k in keys]


_CORPUS = {"wikitext2": "WikiText-2 raw test split", "tinyshakespeare": "tinyshakespeare, last 10% of characters", "piqa": "PIQA validation, question + correct answer"}


def ppl_protocol(rows: list[dict], spec: EvalSpec) -> dict[str, str]:
    """{data: one line saying how its perplexity was measured (corpus, tokens, window, stride)}."""
    out = {}
    for data in spec.ppl:
        r = next((r for r in rows if f"ppl/{data}/windows" in r), None)
        if r is None:
            continue
        windows = r[f"ppl/{data}/windows"]
        out[data] = (
            f"{_CORPUS.get(data, 'text file')}: first {windows * spec.seq_len:,} tokens of the model's tokenization, {windows} "
            f"non-overlapping windows of {spec.seq_len} tokens (stride {spec.seq_len}), each scored without context from "
            f"the previous one ({r[f'ppl/{data}/tokens_scored']:,} predictions); token-level perplexity "
            "(exp of the mean next-token NLL), not lm-eval's word perplexity"
        )
    return out


def to_markdown(rows: list[dict], spec: EvalSpec, title: str = "llmcompress eval") -> str:
    keys, cells = table_rows(rows)
    lines = [f"# {title}", "", f"Settings: `{spec.to_dict()}`", ""]
    protocol = ppl_protocol(rows, spec)
    if protocol:
        lines += ["Perplexity protocol:"] + [f"- `ppl/{d}`: {text}" for d, text in protocol.items()] + [""]
    if spec.tasks:
        lines += [f"lm-eval tasks: {', '.join(spec.tasks)} (n-shot {spec.num_fewshot if spec.num_fewshot is not None else 'task default'}, "
                  f"limit {spec.limit}, batch size {spec.batch_size}); ± is lm-eval's standard error; its own results JSON is "
                  "under `lm_eval/`", ""]
    from llmcompress.table import markdown_table

    lines += markdown_table(["metric", *(str(r["model"]) for r in rows)], [[k, *vals] for k, vals in zip(keys, cells)])
    return "\n".join(lines) + "\n"


def json_rows(rows: list[dict]) -> list[dict]:
    """The rows without lm-eval's in-memory results."""
    return [{k: v for k, v in r.items() if k != LM_EVAL_KEY} for r in rows]


def write_report(out: Path, rows: list[dict], spec: EvalSpec) -> None:
    """report.json and report.md (flat, side by side) and, for lm-eval tasks, lm-eval's own results JSON per model
    under `lm_eval/<model>/results_<date>.json` (its EvaluationTracker's layout and schema)."""
    from llmcompress.io.atomic import atomic_dir, write_json, write_text

    with atomic_dir(Path(out), overwrite=True) as tmp:
        written = [str(r[LM_EVAL_KEY].save(tmp / "lm_eval").relative_to(tmp)) for r in rows if r.get(LM_EVAL_KEY) is not None]
        write_json(tmp / "report.json", {"spec": spec.to_dict(), "ppl_protocol": ppl_protocol(rows, spec), "lm_eval_results": written,
                                         "models": json_rows(rows)})
        write_text(tmp / "report.md", to_markdown(rows, spec))
