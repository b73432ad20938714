"""`llmcompress collapse`: evolutionary layer collapse (GeLaCo) with a Pareto front, plus ShortGPT/LaCo baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcompress.cli._options import (
    AllowPickleOpt,
    DeviceOpt,
    DtypeOpt,
    EngineModelArg,
    MaxMemoryOpt,
    OverwriteOpt,
    PushOpt,
    ResumeOpt,
    SpecOpt,
    given,
)
from llmcompress.collapse.config import Method


def collapse_command(
    model: EngineModelArg = None,
    pareto: Annotated[bool, typer.Option("--pareto", help="Search a Pareto front of (layers, KL) with NSGA-II.")] = False,
    target_layers: Annotated[Optional[int], typer.Option("--target-layers", help="Single-objective: keep exactly N layers.")] = None,
    ratio: Annotated[Optional[float], typer.Option("--ratio", help="Single-objective: keep this fraction of the layers.")] = None,
    method: Annotated[Optional[Method], typer.Option("--method", help="Search method (default gelaco).")] = None,
    population: Annotated[Optional[int], typer.Option("--population", help="Population size.")] = None,
    generations: Annotated[Optional[int], typer.Option("--generations", help="Generations after the initial population.")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed (same seed, same front).")] = None,
    refine_steps: Annotated[Optional[int], typer.Option("--refine-steps", help="Refinement moves per phase (swaps, then swaps + merge coefficients) at the saved layer counts (0: off).")] = None,
    tune_steps: Annotated[Optional[int], typer.Option("--tune-steps", help="gelaco: Adam steps tuning the merge coefficients of the refined solutions on the calibration KL (0: off).")] = None,
    save: Annotated[Optional[str], typer.Option("--save", help="Checkpoints to write: knee | all | LAYERS[,LAYERS].")] = None,
    spec: SpecOpt = None,
    calib_tokens: Annotated[Optional[int], typer.Option("--calib-tokens", help="Calibration tokens.")] = None,
    val_tokens: Annotated[Optional[int], typer.Option("--val-tokens", help="Validation tokens (never optimized on).")] = None,
    calib_data: Annotated[Optional[str], typer.Option("--calib-data", help="Calibration source: wikitext2, a file, or self; NAME:SPLIT picks a split; several joined by commas are mixed.")] = None,
    eval_tokens: Annotated[Optional[int], typer.Option("--eval-tokens", help="WikiText-2 test tokens for the report (held-out self text when WikiText-2 is missing; 0 skips).")] = None,
    piqa_limit: Annotated[Optional[int], typer.Option("--piqa-limit", help="PIQA examples for the report (0 skips).")] = None,
    budget_minutes: Annotated[Optional[float], typer.Option("--budget-minutes", help="Size the search (tokens, population, walk) to about this many minutes, from a short measurement of evaluation speed; the report says what it chose.")] = None,
    max_cache_gb: Annotated[Optional[float], typer.Option("--max-cache-gb", help="Memory for cached states; beyond it they go to disk.")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    max_memory: MaxMemoryOpt = None,
    save_dtype: Annotated[Optional[str], typer.Option("--save-dtype", help="float32 | bfloat16 | float16 for the saved checkpoint (default: the source model's dtype).")] = None,
    resume: ResumeOpt = False,
    allow_pickle: AllowPickleOpt = False,
    overwrite: OverwriteOpt = False,
    out: Annotated[Optional[Path], typer.Option("--out", help="Output directory (default ./runs/collapse-<timestamp>).")] = None,
    push_to_hub: PushOpt = None,
) -> None:
    """Collapse decoder layers by evolutionary search and save ready checkpoints of the chosen solutions."""
    import time

    from llmcompress.collapse.config import CollapseConfig, config_from_dict, load_spec
    from llmcompress.errors import UserError
    from llmcompress.io.stream import parse_memory
    from llmcompress.runtime import resolve_compute

    dev, dt = resolve_compute(device, dtype, model)  # a missing GPU fails here, before anything is read or written
    budget = parse_memory(max_memory)
    cfg = load_spec(spec) if spec is not None else CollapseConfig()
    modes = [m for m in (pareto, target_layers is not None, ratio is not None) if m]
    if len(modes) > 1:
        raise UserError("--pareto, --target-layers and --ratio exclude each other", "pass one of them")
    overrides = given(
        model=model, method=method, population=population, generations=generations, seed=seed, refine_steps=refine_steps,
        tune_steps=tune_steps, save=save, calib_tokens=calib_tokens, val_tokens=val_tokens, calib_source=calib_data,
        eval_tokens=eval_tokens, piqa_limit=piqa_limit, max_cache_gb=max_cache_gb, save_dtype=save_dtype, budget_minutes=budget_minutes,
    )
    if pareto:
        overrides.update(pareto=True, target_layers=None, ratio=None)
    elif target_layers is not None:
        overrides.update(pareto=False, target_layers=target_layers, ratio=None)
    elif ratio is not None:
        overrides.update(pareto=False, ratio=ratio, target_layers=None)
    cfg = config_from_dict(overrides, base=cfg)
    cfg.validate()
    from llmcompress.io.hub import check_push, push

    if push_to_hub and (cfg.save == "all" or "," in cfg.save):
        raise UserError("--push-to-hub uploads one model", "use --save knee or one layer count")
    check_push(push_to_hub)
    if out is None:
        if resume:
            raise UserError("--resume needs the --out directory of the interrupted run", "pass --out DIR")
        out = Path("runs") / f"collapse-{time.strftime('%Y%m%d-%H%M%S')}"

    import contextlib
    import os

    from llmcompress.io.atomic import check_out_dir, removed_if_left_empty
    from llmcompress.io.preflight import check_run_outputs

    main = os.environ.get("RANK", "0") == "0"  # under torchrun rank 0 owns --out; the others write nothing
    if main:
        check_out_dir(out, overwrite=overwrite, resume=resume)
        saves = 4 if cfg.save == "all" else len(cfg.save_counts() or [cfg.save])  # each checkpoint is smaller than the model
        check_run_outputs(out, [cfg.model], out_factor=saves)
    from llmcompress.cli._errors import note_output
    from llmcompress.collapse.pipeline import run_collapse

    if main:
        note_output(out)

    with removed_if_left_empty(out) if main else contextlib.nullcontext():
        result = run_collapse(cfg, out, overwrite=overwrite, resume=resume, device=str(dev), dtype=dt, max_memory=budget)
    if not main:
        return
    typer.echo(f"wrote {result.out_dir}: {len(result.front)} solution(s) on the front, {len(result.saved)} checkpoint(s)")
    for path in result.saved:
        typer.echo(f"  {path}")
    if push_to_hub and result.saved:
        typer.echo(f"pushed {result.saved[0]} to {push_to_hub}: {push(result.saved[0], push_to_hub)}")
