"""lm-evaluation-harness on an in-memory model, with task YAMLs for the local datasets.

Tasks named here with a shipped YAML (`llmcompress/tasks/<name>.yaml`) read their data from the local
data directory, so they run offline; any other name is passed to lm-eval as is, and `include_path`
adds user task YAMLs (lm-eval's --include_path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from llmcompress.errors import DataError, UserError
from llmcompress.paths import data_dir


def shipped_tasks() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("llmcompress.tasks").iterdir() if p.name.endswith(".yaml"))


def _local_task_config(name: str) -> dict:
    import yaml

    text = resources.files("llmcompress.tasks").joinpath(f"{name}.yaml").read_text()
    config = yaml.safe_load(text.replace("{data_dir}", str(data_dir())))
    from llmcompress.data.sources import DATASETS, local_file

    files = (config.get("dataset_kwargs") or {}).get("data_files", {})
    found = local_file(name, DATASETS[name].default_split) if name in DATASETS else None
    if found is not None:  # honours `llmcompress data add` (a registered copy wins over the data directory)
        files.update({k: str(found) for k in files})
    for path in (config.get("dataset_kwargs") or {}).get("data_files", {}).values():
        if not Path(path).is_file():
            raise DataError(
                f"lm-eval task {name!r} needs {path}, which is missing",
                "set LLMCOMPRESS_DATA_DIR to the folder that holds it",
            )
    return config


@dataclass
class LmEvalRun:
    """One lm-eval run: our flat metrics, and lm-eval's own results (with its EvaluationTracker, to save them)."""

    metrics: dict[str, dict[str, float | None]]
    results: dict = field(repr=False)
    samples: dict | None = field(default=None, repr=False)
    tracker: object = field(default=None, repr=False)

    def save(self, output_path: str | Path) -> Path:
        """Write lm-eval's results JSON (and samples with `log_samples`) exactly as `lm_eval --output_path` does:
        `<output_path>/<model name>/results_<date>.json` (+ `samples_<task>_<date>.jsonl`). Returns the results file."""
        tracker = self.tracker
        tracker.output_path = str(output_path)
        before = set(Path(output_path).rglob("results_*.json"))
        tracker.save_results_aggregated(results=dict(self.results), samples=self.samples)
        if self.samples:
            for task in self.results["configs"]:
                tracker.save_results_samples(task_name=task, samples=self.samples[task])
        written = sorted(set(Path(output_path).rglob("results_*.json")) - before)
        if not written:  # lm-eval logs a warning and carries on; a report without its results must not pass silently
            raise UserError(f"lm-eval could not write its results under {output_path}", "check the folder is writable")
        return written[-1]


def flat_metrics(results: dict) -> dict[str, dict[str, float | None]]:
    """{task: {metric: value, metric_stderr: value or None, "n": samples}} from lm-eval's results (first filter)."""
    flat = {}
    for task, metrics in results["results"].items():
        clean: dict[str, float | None] = {}
        for k, v in metrics.items():
            name = k.split(",")[0]
            if name in clean or k in ("alias", "sample_len", "sample_count"):
                continue
            if name.endswith("_stderr"):
                clean[name] = v if isinstance(v, (int, float)) else None  # lm-eval writes "N/A" when not computed
            elif isinstance(v, (int, float)):
                clean[name] = v
        clean["n"] = metrics.get("sample_len")
        flat[task] = clean
    return flat


def run_lm_eval_full(
    model,
    tokenizer,
    tasks: list[str],
    *,
    limit: int | float | None = None,
    batch_size: int = 8,
    include_path: str | Path | None = None,
    num_fewshot: int | None = None,
    apply_chat_template: bool = False,
    log_samples: bool = False,
    model_name: str | None = None,
    bootstrap_iters: int = 100_000,
) -> LmEvalRun:
    """Run lm-eval tasks on an in-memory HF model, tracked by lm-eval's EvaluationTracker (so the results can be
    saved in lm-eval's own layout and schema). `bootstrap_iters` is lm-eval's default; mean metrics such as
    `acc` take a closed-form stderr, so it costs nothing there."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    for name in ("lm-eval", "lm_eval", "lm_eval.evaluator", "lm_eval.api.task", "lm_eval.loggers.evaluation_tracker"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-tasks {include_path} is not a directory", "pass a folder of lm-eval task YAMLs")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot {num_fewshot} is negative", "use 0 or more")
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise UserError("--apply-chat-template: the model's tokenizer has no chat template", "drop --apply-chat-template for a base model")
    local = set(shipped_tasks())
    task_specs = [_local_task_config(t) if t in local else t for t in tasks]
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    tracker = EvaluationTracker()
    name = model_name or getattr(model.config, "_name_or_path", None) or type(model).__name__
    try:
        out = lm_eval.simple_evaluate(
            model=lm, model_args={"pretrained": name}, tasks=task_specs, limit=limit, task_manager=manager,
            num_fewshot=num_fewshot, batch_size=batch_size, apply_chat_template=apply_chat_template,
            log_samples=log_samples, bootstrap_iters=bootstrap_iters, evaluation_tracker=tracker,
        )
    except KeyError as exc:
        raise UserError(f"unknown lm-eval task {exc}", f"use a shipped task ({', '.join(sorted(local))}) or an lm-eval task name") from None
    samples = out.pop("samples", None) if log_samples else None
    out.pop("samples", None)
    return LmEvalRun(flat_metrics(out), out, samples, tracker)


def run_lm_eval(model, tokenizer, tasks: list[str], **kw) -> dict[str, dict[str, float | None]]:
    """Run lm-eval tasks on an in-memory HF model. Returns {task: {metric: value, metric_stderr: value, "n": samples}};
    keyword arguments as `run_lm_eval_full`."""
    return run_lm_eval_full(model, tokenizer, tasks, **kw).metrics
