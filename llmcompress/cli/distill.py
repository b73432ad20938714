"""`llmcompress distill TEACHER`: layer-wise curriculum distillation (or the e2e baseline) into a smaller student."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcompress.actcomp.options import HELP_BUDGET as ACT_HELP_BUDGET
from llmcompress.actcomp.options import HELP_GRAD as ACT_HELP_GRAD
from llmcompress.actcomp.options import HELP_RANK as ACT_HELP_RANK
from llmcompress.actcomp.options import ActGrad
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
from llmcompress.distill.config import (
    CacheDtype,
    DistillConfig,
    GradCompress,
    HiddenLoss,
    Mode,
    Precision,
    Select,
)

D = DistillConfig  # the defaults the help shows come from the config


def distill_command(
    teacher: EngineModelArg = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Output directory (required; refused if it exists, unless --overwrite or --resume).")] = None,
    spec: SpecOpt = None,
    keep_layers: Annotated[Optional[int], typer.Option("--keep-layers", help="Student = teacher with N layers kept.")] = None,
    student: Annotated[Optional[str], typer.Option("--student", help="Student checkpoint whose manifest has a layer_map (e.g. a collapse output).")] = None,
    select: Annotated[Optional[Select], typer.Option("--select", help=f"Which layers --keep-layers keeps: uniform | bi (Block Influence); default {D.select.value}.")] = None,
    train_tokens: Annotated[Optional[int], typer.Option("--train-tokens", help=f"Training budget: tokens each student layer trains on (default {D.train_tokens}: about 10 min on 2 CPU cores).")] = None,
    epochs: Annotated[Optional[int], typer.Option("--epochs", help=f"Passes over the data: train on train-tokens / E distinct tokens E times (the teacher cache is built once; default {D.epochs}).")] = None,
    mode: Annotated[Optional[Mode], typer.Option("--mode", help=f"layerwise (curriculum) | e2e (end-to-end logit KL baseline); default {D.mode.value}.")] = None,
    segments: Annotated[Optional[int], typer.Option("--segments", help="Number of segments (default: one per student layer).")] = None,
    e2e_steps: Annotated[Optional[int], typer.Option("--e2e-steps", help=f"End-to-end logit-KL steps after the layer-wise phases (default {D.e2e_steps}).")] = None,
    e2e_lr: Annotated[Optional[float], typer.Option("--e2e-lr", help="Learning rate of the --e2e-steps phase (default: a quarter of --lr).")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help=f"Training text: wikitext2 | tinyshakespeare | piqa | self | a .txt/.jsonl path; NAME:SPLIT picks a split; several joined by commas are mixed (e.g. wikitext2,tinyshakespeare:all); default {D.data}.")] = None,
    data_split: Annotated[Optional[str], typer.Option("--data-split", help=f"Split of a named dataset (default {D.data_split}).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help=f"Tokens per training block (default {D.seq_len}).")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help=f"Blocks per step (= one cache shard; default {D.batch_size}).")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="AdamW learning rate (default: 2e-3 layer-wise, 5e-4 e2e).")] = None,
    hidden_loss: Annotated[Optional[HiddenLoss], typer.Option("--hidden-loss", help=f"Per-token hidden-state loss: mse (normalised) | cosine; default {D.hidden_loss.value}.")] = None,
    kl_weight: Annotated[Optional[float], typer.Option("--kl-weight", help=f"Weight of the last segment's logit KL (default {D.kl_weight:g}).")] = None,
    ce_weight: Annotated[Optional[float], typer.Option("--ce-weight", help=f"Weight of the next-token cross-entropy on the training text, added to every logit KL (0 = pure distillation; default {D.ce_weight:g}).")] = None,
    phase1_fraction: Annotated[Optional[float], typer.Option("--phase1-fraction", help=f"Share of the budget on teacher inputs (phase 1; default {D.phase1_fraction:g}).")] = None,
    precision: Annotated[Optional[Precision], typer.Option("--precision", help=f"Compute precision of training and caching: fp32 | bf16 (autocast; weights and optimiser stay fp32); default {D.precision.value}.")] = None,
    cache_dtype: Annotated[Optional[CacheDtype], typer.Option("--cache-dtype", help=f"Dtype of the cached teacher features (default {D.cache_dtype.value}).")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option("--cache-dir", help="Where the feature cache lives (default: the llmcompress cache).")] = None,
    eval_tokens: Annotated[Optional[int], typer.Option("--eval-tokens", help=f"WikiText-2 test tokens for the report's perplexities (0 skips; default {D.eval_tokens}).")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", help="torch intra-op threads (default: torch's choice).")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    max_memory: MaxMemoryOpt = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help=f"Random seed (default {D.seed}).")] = None,
    overwrite: OverwriteOpt = False,
    act_rank: Annotated[Optional[str], typer.Option("--act-rank", help=ACT_HELP_RANK)] = None,
    act_budget: Annotated[Optional[float], typer.Option("--act-budget", help=ACT_HELP_BUDGET)] = None,
    act_grad: Annotated[Optional[ActGrad], typer.Option("--act-grad", help=ACT_HELP_GRAD)] = None,
    save_dtype: Annotated[Optional[str], typer.Option("--save-dtype", help="float32 | bfloat16 | float16 for the saved checkpoint (default: the source model's dtype).")] = None,
    resume: ResumeOpt = False,
    allow_pickle: AllowPickleOpt = False,
    keep_work: Annotated[bool, typer.Option("--keep-work", help="Keep OUT/work (segment weights, features, resume state) after success.")] = False,
    push_to_hub: PushOpt = None,
    grad_compress: Annotated[Optional[GradCompress], typer.Option("--grad-compress", help="Gradient exchange of data-parallel e2e training under torchrun: none | zip (lossless) | powersgd (fixed --grad-rank) | edgc (entropy-adapted rank).")] = None,
    grad_rank: Annotated[Optional[int], typer.Option("--grad-rank", help="PowerSGD's rank (--grad-compress powersgd).")] = None,
    grad_rank_min: Annotated[Optional[int], typer.Option("--grad-rank-min", help="EDGC's lowest rank.")] = None,
    grad_rank_max: Annotated[Optional[int], typer.Option("--grad-rank-max", help="EDGC's highest rank (where it starts).")] = None,
    grad_warmup: Annotated[Optional[int], typer.Option("--grad-warmup", help="Dense all-reduce steps before powersgd/edgc compress (>= 2).")] = None,
    grad_entropy_span: Annotated[Optional[float], typer.Option(
        "--grad-entropy-span", help="EDGC: entropy drop, as a share of its peak window, from the highest to the lowest rank (0.1).")] = None,
) -> None:
    """Distil a smaller student from TEACHER: layer-wise, easy-to-hard, from a cached teacher.

    Writes OUT/student (HF checkpoint + llmcompress.json with layer_map), OUT/train_log.jsonl,
    OUT/report.md, OUT/report.json and OUT/metrics.json. Under torchrun, segments are spread over ranks, and
    --mode e2e and the --e2e-steps phase train data-parallel (DDP; --grad-compress picks the gradient exchange).
    """
    from llmcompress.actcomp.options import parse_rank
    from llmcompress.distill.config import DistillConfig, config_from_dict, load_spec
    from llmcompress.errors import UserError
    from llmcompress.io.atomic import check_out_dir
    from llmcompress.runtime import resolve_compute

    # auto is float32 here on any device: the student is cut from the teacher and trained in its dtype
    dev, dt = resolve_compute(device, "float32" if dtype == "auto" else dtype)  # a missing GPU fails here, before anything is written
    if str(dt) != "torch.float32":
        raise UserError(f"distill trains the student's weights in float32, not {dtype}",
                        "pass --dtype float32 (or auto) and --precision bf16 for bfloat16 compute")
    if out is None:
        raise UserError("--out is required", "e.g. --out distilled/")
    from llmcompress.io.stream import parse_memory

    budget = parse_memory(max_memory)
    from llmcompress.io.hub import check_push, push

    check_push(push_to_hub)
    overrides = given(
        teacher=teacher, keep_layers=keep_layers, student=student, select=select, mode=mode,
        train_tokens=train_tokens, epochs=epochs, segments=segments, data=data, data_split=data_split, seq_len=seq_len,
        batch_size=batch_size, lr=lr, hidden_loss=hidden_loss, kl_weight=kl_weight, ce_weight=ce_weight,
        phase1_fraction=phase1_fraction, e2e_steps=e2e_steps, e2e_lr=e2e_lr, precision=precision, cache_dtype=cache_dtype,
        cache_dir=str(cache_dir) if cache_dir else None, eval_tokens=eval_tokens, seed=seed, threads=threads,
        save_dtype=save_dtype, grad_compress=grad_compress, grad_rank=grad_rank, grad_rank_min=grad_rank_min,
        grad_rank_max=grad_rank_max, grad_warmup=grad_warmup, grad_entropy_span=grad_entropy_span,
        act_rank=parse_rank(act_rank), act_budget=act_budget, act_grad=act_grad,
    )
    cfg = config_from_dict(overrides, base=load_spec(spec) if spec is not None else DistillConfig())
    cfg.validate()  # every number, before torch loads
    if os.environ.get("RANK", "0") == "0":  # fail fast, before torch loads (rank 0 only: it creates --out)
        from llmcompress.distill.plan import feature_cache_bytes
        from llmcompress.io.preflight import check_run_outputs, check_writable

        check_out_dir(out, overwrite=overwrite, resume=resume)
        features = feature_cache_bytes(cfg)
        if cfg.cache_dir is None:
            check_run_outputs(out, [cfg.teacher], out_factor=2, cache_extra=features)  # the student and work/ segments
        else:
            check_run_outputs(out, [cfg.teacher], out_factor=2)
            check_writable(Path(cfg.cache_dir), features, "--cache-dir")
    from llmcompress.cli._errors import note_output

    note_output(out)
    from llmcompress.dist import from_env, shutdown
    from llmcompress.distill.engine import distill
    from llmcompress.distill.run import BEFORE_PPL, TEACHER_PPL
    from llmcompress.eval.report import WIKITEXT2_PPL
    info = from_env(dev.type)
    try:
        result = distill(cfg, out, device=str(dev), overwrite=overwrite, resume=resume, dist=info, keep_work=keep_work, max_memory=budget)
    finally:
        shutdown(info)
    if info.is_main:
        m = result.metrics
        typer.echo(f"student: {result.student_dir}  ({m.get('student_layers')} layers, {m.get('student_parameters'):,} parameters)")
        if m.get(WIKITEXT2_PPL) is not None:
            typer.echo(f"perplexity: teacher {m.get(TEACHER_PPL):.2f}, student before {m.get(BEFORE_PPL):.2f}, after {m[WIKITEXT2_PPL]:.2f}")
        typer.echo(f"training wall time {m['train_wall_s']:.1f}s, peak memory {m['peak_rss_mb']:.0f} MiB; report: {out / 'report.md'}")
        if push_to_hub:
            typer.echo(f"pushed {result.student_dir} to {push_to_hub}: {push(result.student_dir, push_to_hub)}")

