"""One formatter for report cells and one markdown table writer, shared by every engine's report.md and
`llmcompress eval` (hand-written: a few lines, where tabulate or rich would add a dependency for no gain)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def fmt(v: Any, spec: str | None = None, none: str = "—") -> str:
    """One cell: `none` for None; a float in `spec` (default: 4 decimals below 10, else thousands and one
    decimal); an int with thousands separators; anything else as text."""
    if v is None:
        return none
    if isinstance(v, float):
        if spec is not None:
            return format(v, spec)
        return f"{v:.4f}" if abs(v) < 10 else f"{v:,.1f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> list[str]:
    """The lines of a markdown table; `align` has one letter per column (l left, r right), default all left.
    Cells are written as given (format them with `fmt` first)."""
    align = align or "l" * len(header)
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "".join("---:|" if a == "r" else "---|" for a in align)]
    return lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows]


__all__ = ["fmt", "markdown_table"]
