"""`llmcompress nas`: joint differentiable architecture search and mixed-precision quantization."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcompress.actcomp.options import HELP_BUDGET as ACT_HELP_BUDGET
from llmcompress.actcomp.options import HELP_RANK as ACT_HELP_RANK
from llmcompress.cli._options import (
    AllowPickleOpt,
    DeviceOpt,
    DtypeOpt,
    EngineModelArg,
    OverwriteOpt,
    PushOpt,
    ResumeOpt,
    SpecOpt,
    given,
)
from llmcompress.nas.config import CostModel, Mode, QuantMethod


def _int_list(text: str, what: str) -> list[int]:
    from llmcompress.errors import UserError

    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}", "e.g. --bits 2,3,4,8,16") from None


def nas_command(
    model: EngineModelArg = None,
    target_latency: Annotated[Optional[float], typer.Option("--target-latency", help="Modeled latency relative to dense (e.g. 0.6).")] = None,
    target_size_mb: Annotated[Optional[float], typer.Option("--target-size-mb", help="Packed size in MB.")] = None,
    target_bits: Annotated[Optional[float], typer.Option("--target-bits", help="Average bits per quantized weight.")] = None,
    mode: Annotated[Optional[Mode], typer.Option("--mode", help="joint (default) | sequential | uniform.")] = None,
    baselines: Annotated[Optional[str], typer.Option("--baselines", help="Extra modes for the report, e.g. sequential,uniform ('' for none).")] = None,
    bits: Annotated[Optional[str], typer.Option("--bits", help="Bit widths to choose from (default 2,3,4,8,16).")] = None,
    head_bits: Annotated[Optional[str], typer.Option("--head-bits", help="Bit widths the output head (tied: with the embedding) may take, e.g. 4,8,16; default: the head is not searched.")] = None,
    group_size: Annotated[Optional[int], typer.Option("--group-size", help="Quantization group size (default: 128 if it divides all widths, else 64...).")] = None,
    cost_model: Annotated[Optional[CostModel], typer.Option("--cost-model", help="analytic (bytes per decoded token, default) | lut (torch decode time measured here) | measured (llama.cpp decode time of the GGUF, probe table timed here; needs pip install -e .[runtime]).")] = None,
    quant_method: Annotated[Optional[QuantMethod], typer.Option("--quant", help="How the plan is applied: gptq (default, error compensation) | rtn.")] = None,
    train_tokens: Annotated[Optional[int], typer.Option("--train-tokens", help="Search tokens (default 16384).")] = None,
    eval_tokens: Annotated[Optional[int], typer.Option("--eval-tokens", help="WikiText-2 test tokens for the report (0 skips).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed.")] = None,
    spec: SpecOpt = None,
    export: Annotated[Optional[str], typer.Option("--export", help="Deployable formats next to hf/: gguf, compressed-tensors (comma-separated).")] = None,
    act_rank: Annotated[Optional[str], typer.Option("--act-rank", help=ACT_HELP_RANK)] = None,
    act_budget: Annotated[Optional[float], typer.Option("--act-budget", help=ACT_HELP_BUDGET)] = None,
    save_dtype: Annotated[Optional[str], typer.Option("--save-dtype", help="float32 | bfloat16 | float16 for saved float tensors (default: the source model's dtype).")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    resume: ResumeOpt = False,
    allow_pickle: AllowPickleOpt = False,
    overwrite: OverwriteOpt = False,
    out: Annotated[Optional[Path], typer.Option("--out", help="Output directory (refused if it exists, unless --overwrite/--resume).")] = None,
    push_to_hub: PushOpt = None,
) -> None:
    """Search layer skips, MLP widths and per-layer bit widths under a latency/size/bits target; save hf/ (dequantized) and --export gguf/compressed-tensors."""
    from llmcompress.actcomp.options import parse_rank
    from llmcompress.errors import UserError
    from llmcompress.nas.config import NasConfig, config_from_dict, load_spec
    from llmcompress.runtime import resolve_compute

    dev, dt = resolve_compute(device, dtype, model)  # a missing GPU fails here, before anything is written
    if out is None:
        raise UserError("--out is required", "pass --out DIR")
    from llmcompress.io.hub import check_push, push

    check_push(push_to_hub)
    cfg = load_spec(spec) if spec is not None else NasConfig()
    overrides = given(
        model=model, target_latency=target_latency, target_size_mb=target_size_mb, target_bits=target_bits,
        mode=mode, group_size=group_size, cost_model=cost_model, quant_method=quant_method,
        train_tokens=train_tokens, eval_tokens=eval_tokens, seed=seed,
        bits=_int_list(bits, "--bits") if bits is not None else None,
        head_bits=_int_list(head_bits, "--head-bits") if head_bits is not None else None,
        baselines=[b.strip() for b in baselines.split(",") if b.strip()] if baselines is not None else None,
        export=[f.strip() for f in export.split(",") if f.strip()] if export is not None else None,
        save_dtype=save_dtype, act_rank=parse_rank(act_rank), act_budget=act_budget,
    )
    cfg = config_from_dict(overrides, base=cfg)
    cfg.validate()
    from llmcompress.io.atomic import check_out_dir, removed_if_left_empty

    check_out_dir(out, overwrite, resume)
    from llmcompress.io.preflight import check_run_outputs

    check_run_outputs(out, [cfg.model], out_factor=2)  # the packed and the HF checkpoint, each at most the model's size
    from llmcompress.cli._errors import note_output

    note_output(out)
    from llmcompress.nas.pipeline import run_nas

    with removed_if_left_empty(out):
        run = run_nas(cfg, out, overwrite=overwrite, resume=resume, device=str(dev), dtype=dt)
    a = run.arch
    typer.echo(f"wrote {run.out_dir}: avg bits {a['avg_bits']:.2f}, modeled latency {a['modeled_latency']:.3f}, "
               f"size {a['size_mb']:.1f} MB, hf/ (dequantized, {a.get('hf_dtype')}) {a.get('hf_disk_mb', 0):.1f} MB")
    for fmt, e in a.get("exports", {}).items():
        typer.echo(f"  {fmt}: {e['path']} ({e['bytes'] / 1e6:.1f} MB)" + (f"; {e['note']}" if e.get("note") else ""))
    if push_to_hub:
        typer.echo(f"pushed {run.out_dir / 'hf'} to {push_to_hub}: {push(run.out_dir / 'hf', push_to_hub)}")
