"""`llmcompress eval MODEL [MODEL ...]`: perplexity, lm-eval tasks, size and speed, side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcompress.cli._options import AllowPickleOpt, DeviceOpt, DtypeOpt, MaxMemoryOpt, OverwriteOpt, TrustOpt


def eval_command(
    models: Annotated[Optional[list[str]], typer.Argument(help="Models to compare (aliases, directories, .gguf files).")] = None,
    ppl: Annotated[list[str], typer.Option("--ppl", help="Perplexity dataset or file (repeatable); 'none' to skip.")] = ["wikitext2"],  # noqa: B006
    seq_len: Annotated[int, typer.Option("--seq-len", help="Window length for perplexity.")] = 512,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Score at most this many tokens (0: all).")] = 16384,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Batch size for perplexity and lm-eval.")] = 4,
    tasks: Annotated[str, typer.Option("--tasks", help="Comma-separated lm-eval tasks (shipped: piqa).")] = "",
    limit: Annotated[Optional[float], typer.Option("--limit", help="lm-eval: samples per task (or fraction).")] = None,
    num_fewshot: Annotated[Optional[int], typer.Option("--num-fewshot", help="lm-eval: few-shot examples per prompt (default: each task's).")] = None,
    apply_chat_template: Annotated[bool, typer.Option("--apply-chat-template", help="lm-eval: wrap prompts in the tokenizer's chat template.")] = False,
    log_samples: Annotated[bool, typer.Option("--log-samples", help="lm-eval: also write every sample (needs --out).")] = False,
    include_tasks: Annotated[Optional[Path], typer.Option("--include-tasks", help="Folder of extra lm-eval task YAMLs.")] = None,
    speed: Annotated[bool, typer.Option("--speed/--no-speed", help="Measure prefill/decode speed.")] = True,
    runtime: Annotated[str, typer.Option("--runtime", help="torch | llama.cpp: also run each .gguf in llama.cpp (llama-cpp-python, the [runtime] extra), next to torch on the same weights.")] = "torch",
    threads: Annotated[int, typer.Option("--threads", help="llama.cpp threads (0: all cores).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", "--output-path", help="Write report.json, report.md and (with --tasks) lm-eval's results JSON under lm_eval/ here.")] = None,
    overwrite: OverwriteOpt = False,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    max_memory: MaxMemoryOpt = None,
    trust_remote_code: TrustOpt = False,
    allow_pickle: AllowPickleOpt = False,
) -> None:
    """Evaluate models: perplexity, lm-evaluation-harness tasks, size and speed, in one table."""
    from llmcompress.errors import UserError
    from llmcompress.eval.llamacpp import RUNTIMES, evaluate_llamacpp, require_llama_cpp
    from llmcompress.eval.report import EvalSpec, evaluate, json_rows, table_rows, write_report
    from llmcompress.io.atomic import check_out_dir
    from llmcompress.io.load import ALIASES, DEFAULT_MODEL, alias_gguf_path, load_model, resolve
    from llmcompress.io.stream import parse_memory, should_stream
    from llmcompress.runtime import resolve_compute

    dev, _ = resolve_compute(device, dtype)  # a missing GPU fails here, before anything is read or written
    budget = parse_memory(max_memory)
    models = models or [DEFAULT_MODEL]
    if log_samples and (out is None or not tasks.strip()):
        raise UserError("--log-samples needs lm-eval tasks and a place to write them", "pass --tasks and --out")
    if runtime not in RUNTIMES:
        raise UserError(f"unknown runtime {runtime!r}", f"use one of {', '.join(RUNTIMES)}")
    from llmcompress.spec import MAX_THREADS, Int, check_ranges

    check_ranges({"threads": threads}, {"threads": Int("--threads", 0, MAX_THREADS, note="0 uses every core")})
    spec = EvalSpec(
        ppl=[p for p in ppl if p.lower() != "none"],
        seq_len=seq_len,
        max_tokens=max_tokens or None,
        batch_size=batch_size,
        tasks=[t.strip() for t in tasks.split(",") if t.strip()],
        limit=limit,
        include_tasks=str(include_tasks) if include_tasks else None,
        speed=speed,
        num_fewshot=num_fewshot,
        apply_chat_template=apply_chat_template,
        log_samples=log_samples,
    )
    spec.validate()
    if spec.limit is not None and spec.limit >= 1:
        spec.limit = int(spec.limit)
    if out is not None:
        check_out_dir(out, overwrite=overwrite)
    ggufs = {}
    for m in models:  # validate every model before the first slow step
        kind, where = resolve(m)
        if runtime == "llama.cpp":
            if kind not in ("gguf", "alias"):
                raise UserError(f"--runtime llama.cpp runs .gguf files; {m} is not one", f"export it first: llmcompress export {m} --to gguf --out model.gguf")
            ggufs[m] = where if kind == "gguf" else alias_gguf_path(ALIASES[where])
    if runtime == "llama.cpp":
        require_llama_cpp()
    from llmcompress.io.preflight import MB, check_run_outputs

    check_run_outputs(out, models, out_extra=MB, uses_cache=bool(spec.ppl))  # before any model loads
    if spec.ppl:
        from llmcompress.data.sources import load_texts

        for data in spec.ppl:  # unknown dataset / empty file: fail before loading any model
            load_texts(data)
    rows = []
    for m in models:
        _, dt = resolve_compute(device, dtype, m)
        streamed = should_stream(m, dt, dev, budget, what="perplexity") if runtime == "torch" else None
        if streamed is not None:  # larger than the budget: perplexity layer by layer from disk
            from llmcompress.eval.report import evaluate_streamed

            rows.append(evaluate_streamed(m, streamed, spec, dtype=dt, device=dev))
            continue
        lm = load_model(m, dtype=dt, device=dev, trust_remote_code=trust_remote_code)
        rows.append(evaluate(lm, spec, path=ggufs.get(m) or (m if Path(m).exists() else None)))
        if runtime == "llama.cpp":  # the same weights in llama.cpp, next to their torch row
            rows[-1]["model"] = f"{m} [torch]"
            rows[-1]["runtime"] = "torch"
            rows.append(evaluate_llamacpp(ggufs[m], lm.tokenizer, spec, threads=threads or None, torch_row=rows[-1]))
            rows[-1]["model"] = f"{m} [llama.cpp]"
        del lm
    if out is not None:
        write_report(out, rows, spec)
    if as_json:
        typer.echo(json.dumps({"spec": spec.to_dict(), "models": json_rows(rows)}, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    keys, cells = table_rows(rows)
    table = Table(title="llmcompress eval")
    table.add_column("metric")
    for r in rows:
        table.add_column(str(r["model"]), justify="right")
    for k, vals in zip(keys, cells):
        table.add_row(k, *vals)
    Console().print(table)
    if out is not None:
        Console().print(f"report written to {out}/report.md")
