"""Shared option aliases, so every command spells model, device, dtype and output the same way.

Engine commands (collapse, distill, nas) default every config option to None, "not given": the config
(`--spec FILE`, else the dataclass defaults) supplies the value, and `given` keeps only what the user set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

ModelArg = Annotated[str, typer.Argument(help="Model: alias (smollm2-135m), HF directory, .gguf file or hub id.")]
EngineModelArg = Annotated[Optional[str], typer.Argument(
    help="Model: alias, HF directory, .gguf file or hub id (default: the --spec's, else smollm2-135m).", show_default=False)]
SpecOpt = Annotated[Optional[Path], typer.Option("--spec", help="YAML spec of config fields (CLI flags override its fields).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto | cpu | cuda | cuda:N (auto takes a GPU when present).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto | bfloat16 | float16 | float32: compute dtype (auto: the source's dtype on a GPU, float32 on the CPU).")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option(
    "--max-memory", help="Memory budget for the model, e.g. 8GiB or 500MB (default: the memory this machine has "
    "available). A model larger than it is streamed from disk layer by layer; 0 always streams.")]
OutOpt = Annotated[Path, typer.Option("--out", help="Output directory (refused if it exists, unless --overwrite).")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run in --out.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the checkpoint (off by default).")]


def _allow_pickle(value: bool) -> bool:
    if value:  # read by llmcompress.io.load.pickle_allowed, also in torchrun ranks and nested loads
        os.environ["LLMCOMPRESS_ALLOW_PICKLE"] = "1"
    return value


AllowPickleOpt = Annotated[bool, typer.Option(
    "--allow-pickle", callback=_allow_pickle,
    help="Load a model that has only pickle weights (pytorch_model.bin), with torch's weights_only loader.")]
PushOpt = Annotated[Optional[str], typer.Option("--push-to-hub", help="Upload the saved model to this hub repo (OWNER/NAME) when online.")]


def given(**options) -> dict:
    """The options the user gave (not None), Enum choices as their values: the overrides of a config."""
    from enum import Enum

    return {k: (v.value if isinstance(v, Enum) else v) for k, v in options.items() if v is not None}
