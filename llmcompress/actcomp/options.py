"""`--act-rank R|auto`, `--act-budget F` and `--act-grad dense|factored`: parsing, choices and ranges (no torch
import: the CLI stays fast)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from llmcompress.spec import MAX_SEQ, Range, Real


@dataclass(frozen=True)
class _RankRange(Range):
    """An integer range that also takes the word auto."""

    def check(self, value: Any) -> None:
        if isinstance(value, str):
            value = parse_rank(value)
        if value != "auto":
            super().check(value)


RANK = _RankRange("--act-rank", 1, MAX_SEQ, note="e.g. --act-rank 64 (rank of every linear input's sketch) or --act-rank auto")
BUDGET = Real("--act-budget", 0.0, 1.0, lo_open=True, note="e.g. --act-budget 0.25 (sketches hold a quarter of the linear inputs' bytes)")
HELP_RANK = ("Compress the activations linear layers save for backward to rank R random sketches (unbiased weight "
             "gradients), or auto: per-input ranks from --act-budget. Default: off.")
HELP_BUDGET = "With --act-rank auto: the sketches' share of the uncompressed linear-input bytes (0 < F <= 1)."
HELP_GRAD = ("With --act-rank: dense (default) writes each sketched weight gradient into .grad; factored "
             "(co-compression) keeps it as its rank-r factors and steps AdamW from them one linear at a time "
             "(llmcompress/actcomp/optim.py), so the trained linears' dense gradients are never all alive.")


class ActGrad(str, Enum):
    """How the sketched linears' weight gradients reach the optimizer (llmcompress/actcomp/optim.py)."""

    DENSE = "dense"  # U·V written into .grad; the optimizer steps as usual
    FACTORED = "factored"  # co-compression: kept as U, V; FactoredStep forms and frees one linear's gradient at a time


def check_grad(act_grad: ActGrad, act_rank) -> None:
    """UserError when factored gradients are asked for without compression (there are no factors)."""
    from llmcompress.errors import UserError

    if act_grad == ActGrad.FACTORED and act_rank is None:
        raise UserError("--act-grad factored keeps the sketched weight gradients as factors, and this run sketches none",
                        "add --act-rank R (e.g. --act-rank 64 or --act-rank auto), or drop --act-grad")


def parse_rank(text: str | int | None) -> int | str | None:
    """'auto' -> 'auto', '64' -> 64, None -> None; anything else is a UserError."""
    from llmcompress.errors import UserError

    if text is None or isinstance(text, int):
        return text
    t = str(text).strip().lower()
    if t == "auto":
        return "auto"
    try:
        return int(t)
    except ValueError:
        raise UserError(f"--act-rank must be a positive integer or auto (got {text!r})", RANK.note) from None
