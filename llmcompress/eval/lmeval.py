"""lm-evaluation-harness on an in-memory model, with task YAMLs for the local datasets.

Tasks named here with a shipped YAML (`llmcompress/tasks/<name>.yaml`) read their data from the local
data directory, so they run offline; any other name is passed to lm-eval as is, and `include_path`
adds user task YAMLs (lm-eval's --include_path).
"""

from __future__ import annotations

import logging
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


def run_lm_eval(
    model,
    tokenizer,
    tasks: list[str],
    *,
    limit: int | float | None = None,
    batch_size: int = 8,
    include_path: str | Path | None = None,
    num_fewshot: int | None = None,
) -> dict[str, dict[str, float]]:
    """Run lm-eval tasks on an in-memory HF model. Returns {task: {metric: value, "n": samples}}."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    for name in ("lm-eval", "lm_eval", "lm_eval.evaluator", "lm_eval.api.task"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-tasks {include_path} is not a directory", "pass a folder of lm-eval task YAMLs")
    local = set(shipped_tasks())
    task_specs = [_local_task_config(t) if t in local else t for t in tasks]
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    try:
        out = lm_eval.simple_evaluate(
            model=lm, tasks=task_specs, limit=limit, task_manager=manager, num_fewshot=num_fewshot,
            log_samples=False, bootstrap_iters=0,
        )
    except KeyError as exc:
        raise UserError(f"unknown lm-eval task {exc}", f"use a shipped task ({', '.join(sorted(local))}) or an lm-eval task name") from None
    results = {}
    for task, metrics in out["results"].items():
        clean = {
            k.split(",")[0]: v
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and "stderr" not in k and k != "sample_len"
        }
        clean["n"] = metrics.get("sample_len")
        results[task] = clean
    return results
