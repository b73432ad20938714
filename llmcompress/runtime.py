"""Device, dtype, thread-count and seed resolution: done once at the edge, passed inward as torch objects."""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING

from llmcompress.errors import UserError

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")


def resolve_device(name: str = "auto") -> tuple[torch.device, str]:
    """Return (device, reason). `auto` takes a GPU when one is present."""
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), "auto: CUDA device found"
        return torch.device("cpu"), "auto: no CUDA device, using CPU"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} asked for but no CUDA device is available", "use --device cpu or auto")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise UserError(f"unknown device {name!r}", "use auto, cpu or cuda")
    return torch.device(name), "asked for"


def resolve_dtype(name: str = "float32") -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}", f"use one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def autocast(device, precision: str = "fp32"):
    """Context for forward passes at `precision`: fp32 (no change) or bf16 autocast on `device`.

    bf16 runs matmuls in bfloat16 (AMX on recent Xeons, tensor cores on GPUs); weights, gradients and
    optimiser state stay fp32, and losses that cast to float are computed in fp32.
    """
    import contextlib

    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16":
        raise ValueError(f"unknown precision {precision!r}")
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def default_threads(cap: int | None = None) -> int:
    """Threads for a CPU-bound pool: the cores this process may run on (its affinity), at most `cap`."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, n if cap is None else min(n, cap))


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
