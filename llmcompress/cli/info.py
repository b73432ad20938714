"""`llmcompress info MODEL`: architecture summary."""

from __future__ import annotations

import json

import typer

from llmcompress.cli._options import AllowPickleOpt, DtypeOpt, ModelArg, TrustOpt
from llmcompress.io.load import DEFAULT_MODEL


def info_command(
    model: ModelArg = DEFAULT_MODEL,
    dtype: DtypeOpt = "float32",
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    trust_remote_code: TrustOpt = False,
    allow_pickle: AllowPickleOpt = False,
) -> None:
    """Show an architecture summary: family, layers, hidden size, heads, KV heads, parameters, dtype."""
    from llmcompress.io.load import load_model
    from llmcompress.runtime import resolve_dtype

    lm = load_model(model, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code)
    cfg = lm.model.config
    summary = {
        "model": model,
        "family": lm.adapter.family,
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "heads": getattr(cfg, "num_attention_heads", None),
        "kv_heads": getattr(cfg, "num_key_value_heads", getattr(cfg, "num_attention_heads", None)),
        "intermediate_size": getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None),
        "vocab_size": cfg.vocab_size,
        "parameters": sum(p.numel() for p in lm.model.parameters()),
        "dtype": str(next(lm.model.parameters()).dtype).replace("torch.", ""),
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"llmcompress info: {model}", show_header=False)
    for k, v in summary.items():
        table.add_row(k, f"{v:,}" if isinstance(v, int) else str(v))
    Console().print(table)
