"""`llmcompress export SRC --to gguf|compressed-tensors --out PATH`: deployable quantized files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcompress.cli._options import DeviceOpt, DtypeOpt, MaxMemoryOpt, ModelArg, OverwriteOpt


def export_command(
    model: ModelArg,
    to: Annotated[str, typer.Option("--to", help="gguf (one file: llama.cpp, Ollama, LM Studio) | compressed-tensors (a directory: vLLM, transformers).")],
    out: Annotated[Path, typer.Option("--out", help="Output: a .gguf file for --to gguf, a directory for compressed-tensors.")],
    bits: Annotated[int, typer.Option("--bits", help="4 | 5 | 8 bits for every decoder linear; 16 = no quantization (source dtype).")] = 4,
    quant: Annotated[str, typer.Option("--quant", help="rtn | gptq (calibrated as nas calibrates it).")] = "rtn",
    group_size: Annotated[int, typer.Option("--group-size", help="32 | 64 | 128 (default: 32 for gguf, 128 for compressed-tensors).")] = 0,
    sym: Annotated[Optional[bool], typer.Option("--sym/--asym", help="Symmetric (Q4_0/Q5_0/Q8_0) or asymmetric (Q4_1/Q5_1) groups (default: asym below 8 bits).")] = None,
    plan: Annotated[Optional[Path], typer.Option("--plan", help="A nas arch.json: per-linear bits (overrides --bits).")] = None,
    save_dtype: Annotated[Optional[str], typer.Option("--save-dtype", help="float32 | bfloat16 | float16 for unquantized tensors (default: the source's dtype).")] = None,
    calib_data: Annotated[Optional[str], typer.Option("--calib-data", help="GPTQ calibration data (default: as nas, wikitext2 valid).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Random seed (calibration blocks).")] = 0,
    embed_bits: Annotated[Optional[int], typer.Option("--embed-bits", help="gguf: token embedding / output matrix as 8 (Q8_0) | 4 (Q4_0) | 16 (source dtype) (default: 8 when quantizing).")] = None,
    separate_output: Annotated[bool, typer.Option("--separate-output", help="gguf: also write a tied output matrix as its own output.weight, which llama.cpp repacks for its fast CPU matmul (a second copy: +16 MB at Q4_0 for smollm2-135m); with --quant gptq it gets its own GPTQ integers.")] = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    max_memory: MaxMemoryOpt = None,
    overwrite: OverwriteOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Quantize a model (RTN or GPTQ, or a nas plan) and write GGUF or compressed-tensors. Under torchrun, GPTQ's
    linears are spread over the ranks and rank 0 writes."""
    from llmcompress.dist import from_env, leave
    from llmcompress.export.api import ExportOptions, export_model
    from llmcompress.io.stream import parse_memory
    from llmcompress.runtime import resolve_compute

    dev, dt = resolve_compute(device, dtype, model)  # a missing GPU fails here, before anything is written
    budget = parse_memory(max_memory)
    opts = ExportOptions(bits=bits, quant=quant, group_size=group_size, sym=sym, plan=plan, save_dtype=save_dtype,
                         calib_source=calib_data, seed=seed, embed_bits=embed_bits,
                         separate_output=separate_output)
    opts.validate(to)  # a bad option fails before the process group is joined
    info = from_env(dev.type)
    try:
        summary = export_model(model, to, out, opts, overwrite=overwrite, device=dev, dtype=dt, max_memory=budget)
    finally:
        leave(info)  # no barrier: the other ranks are done once the integers are exchanged
    if not info.is_main:
        return
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    types = summary.get("tensor_types")
    typer.echo(f"wrote {summary['path']} ({to}): {summary['bytes'] / 1e6:.1f} MB, {summary['parameters'] / 1e6:.1f}M parameters"
               + (f", tensor types {types}" if types else "") + f", unquantized tensors in {summary['float_dtype']}")
    for note in summary.get("notes", []):
        typer.echo(f"note: {note}")
