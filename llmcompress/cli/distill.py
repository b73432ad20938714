"""`llmcompress distill TEACHER`: layer-wise curriculum distillation (or the e2e baseline) into a smaller student."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcompress.actcomp.options import HELP_BUDGET as ACT_HELP_BUDGET
from llmcompress.actcomp.options import HELP_RANK as ACT_HELP_RANK
from llmcompress.cli._options import (
    AllowPickleOpt,
    DeviceOpt,
    ModelArg,
    OverwriteOpt,
    PushOpt,
    ResumeOpt,
    SeedOpt,
)


class ModeChoice(str, Enum):
    layerwise = "layerwise"
    e2e = "e2e"


class SelectChoice(str, Enum):
    uniform = "uniform"
    bi = "bi"


class LossChoice(str, Enum):
    mse = "mse"
    cosine = "cosine"


class PrecisionChoice(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class CacheDtypeChoice(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


def distill_command(
    teacher: ModelArg = "smollm2-135m",
    out: Annotated[Optional[Path], typer.Option("--out", help="Output directory (required; refused if it exists, unless --overwrite or --resume).")] = None,
    keep_layers: Annotated[Optional[int], typer.Option("--keep-layers", help="Student = teacher with N layers kept.")] = None,
    student: Annotated[Optional[str], typer.Option("--student", help="Student checkpoint whose manifest has a layer_map (e.g. a collapse output).")] = None,
    select: Annotated[SelectChoice, typer.Option("--select", help="Which layers --keep-layers keeps: uniform | bi (Block Influence).")] = SelectChoice.uniform,
    train_tokens: Annotated[int, typer.Option("--train-tokens", help="Training budget: tokens each student layer trains on (default: about 10 min on 2 CPU cores).")] = 16384,
    epochs: Annotated[int, typer.Option("--epochs", help="Passes over the data: train on train-tokens / E distinct tokens E times (the teacher cache is built once).")] = 1,
    mode: Annotated[ModeChoice, typer.Option("--mode", help="layerwise (curriculum) | e2e (end-to-end logit KL baseline).")] = ModeChoice.layerwise,
    segments: Annotated[Optional[int], typer.Option("--segments", help="Number of segments (default: one per student layer).")] = None,
    e2e_steps: Annotated[int, typer.Option("--e2e-steps", help="End-to-end logit-KL steps after the layer-wise phases.")] = 0,
    e2e_lr: Annotated[Optional[float], typer.Option("--e2e-lr", help="Learning rate of the --e2e-steps phase (default: a quarter of --lr).")] = None,
    data: Annotated[str, typer.Option("--data", help="Training text: wikitext2 | tinyshakespeare | piqa | self | a .txt/.jsonl path; NAME:SPLIT picks a split; several joined by commas are mixed (e.g. wikitext2,tinyshakespeare:all).")] = "wikitext2",
    data_split: Annotated[str, typer.Option("--data-split", help="Split of a named dataset.")] = "valid",
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per training block.")] = 256,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Blocks per step (= one cache shard).")] = 4,
    lr: Annotated[Optional[float], typer.Option("--lr", help="AdamW learning rate (default: 2e-3 layer-wise, 5e-4 e2e).")] = None,
    hidden_loss: Annotated[LossChoice, typer.Option("--hidden-loss", help="Per-token hidden-state loss: mse (normalised) | cosine.")] = LossChoice.mse,
    kl_weight: Annotated[float, typer.Option("--kl-weight", help="Weight of the last segment's logit KL.")] = 1.0,
    ce_weight: Annotated[float, typer.Option("--ce-weight", help="Weight of the next-token cross-entropy on the training text, added to every logit KL (0 = pure distillation).")] = 0.0,
    phase1_fraction: Annotated[float, typer.Option("--phase1-fraction", help="Share of the budget on teacher inputs (phase 1).")] = 0.25,
    precision: Annotated[PrecisionChoice, typer.Option("--precision", help="Compute precision of training and caching: fp32 | bf16 (autocast; weights and optimiser stay fp32).")] = PrecisionChoice.fp32,
    cache_dtype: Annotated[CacheDtypeChoice, typer.Option("--cache-dtype", help="Dtype of the cached teacher features.")] = CacheDtypeChoice.bf16,
    cache_dir: Annotated[Optional[Path], typer.Option("--cache-dir", help="Where the feature cache lives (default: the llmcompress cache).")] = None,
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", help="WikiText-2 test tokens for the report's perplexities (0 skips).")] = 8192,
    threads: Annotated[Optional[int], typer.Option("--threads", help="torch intra-op threads (default: torch's choice).")] = None,
    device: DeviceOpt = "auto",
    seed: SeedOpt = 0,
    overwrite: OverwriteOpt = False,
    act_rank: Annotated[Optional[str], typer.Option("--act-rank", help=ACT_HELP_RANK)] = None,
    act_budget: Annotated[float, typer.Option("--act-budget", help=ACT_HELP_BUDGET)] = 0.25,
    save_dtype: Annotated[Optional[str], typer.Option("--save-dtype", help="float32 | bfloat16 | float16 for the saved checkpoint (default: the source model's dtype).")] = None,
    resume: ResumeOpt = False,
    allow_pickle: AllowPickleOpt = False,
    keep_work: Annotated[bool, typer.Option("--keep-work", help="Keep OUT/work (segment weights, features, resume state) after success.")] = False,
    push_to_hub: PushOpt = None,
) -> None:
    """Distil a smaller student from TEACHER: layer-wise, easy-to-hard, from a cached teacher.

    Writes OUT/student (HF checkpoint + llmcompress.json with layer_map), OUT/train_log.jsonl,
    OUT/report.md and OUT/metrics.json. Under torchrun, segments are spread over ranks.
    """
    from llmcompress.actcomp.options import parse_rank
    from llmcompress.distill import DistillConfig
    from llmcompress.errors import UserError
    from llmcompress.io.atomic import check_out_dir

    if out is None:
        raise UserError("--out is required", "e.g. --out distilled/")
    from llmcompress.io.hub import check_push, push

    check_push(push_to_hub)
    cfg = DistillConfig(
        teacher=teacher, keep_layers=keep_layers, student=student, select=select.value, mode=mode.value,
        train_tokens=train_tokens, epochs=epochs, segments=segments, data=data, data_split=data_split, seq_len=seq_len,
        batch_size=batch_size, lr=lr, hidden_loss=hidden_loss.value, kl_weight=kl_weight, ce_weight=ce_weight,
        phase1_fraction=phase1_fraction, e2e_steps=e2e_steps, e2e_lr=e2e_lr, precision=precision.value, cache_dtype=cache_dtype.value,
        cache_dir=str(cache_dir) if cache_dir else None, eval_tokens=eval_tokens, seed=seed, threads=threads,
        save_dtype=save_dtype, act_rank=parse_rank(act_rank), act_budget=act_budget,
    )
    cfg.validate()  # every number, before torch loads
    if os.environ.get("RANK", "0") == "0":  # fail fast, before torch loads (rank 0 only: it creates --out)
        from llmcompress.distill.plan import feature_cache_bytes
        from llmcompress.io.preflight import check_run_outputs, check_writable

        check_out_dir(out, overwrite=overwrite, resume=resume)
        features = feature_cache_bytes(cfg)
        if cache_dir is None:
            check_run_outputs(out, [teacher], out_factor=2, cache_extra=features)  # the student and work/ segments
        else:
            check_run_outputs(out, [teacher], out_factor=2)
            check_writable(cache_dir, features, "--cache-dir")
    from llmcompress.cli._errors import note_output

    note_output(out)
    from llmcompress.distill.dist import from_env, shutdown
    from llmcompress.distill.engine import distill
    from llmcompress.runtime import resolve_device

    dev, _ = resolve_device(device)
    info = from_env(dev.type)
    try:
        result = distill(cfg, out, device=str(dev), overwrite=overwrite, resume=resume, dist=info, keep_work=keep_work)
    finally:
        shutdown(info)
    if info.is_main:
        m = result.metrics
        typer.echo(f"student: {result.student_dir}  ({m.get('student_layers')} layers, {m.get('student_parameters'):,} parameters)")
        if m.get("student_ppl") is not None:
            typer.echo(f"perplexity: teacher {m.get('teacher_ppl'):.2f}, student before {m.get('student_ppl_before'):.2f}, after {m['student_ppl']:.2f}")
        typer.echo(f"training wall time {m['train_wall_s']:.1f}s, peak memory {m['peak_rss_mb']:.0f} MiB; report: {out / 'report.md'}")
        if push_to_hub:
            typer.echo(f"pushed {result.student_dir} to {push_to_hub}: {push(result.student_dir, push_to_hub)}")
