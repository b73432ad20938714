"""Device, dtype, thread-count and seed resolution: done once at the edge, passed inward as torch objects."""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING

from llmcompress.errors import UserError

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPES)


def resolve_device(name: str = "auto") -> tuple[torch.device, str]:
    """Return (device, reason). `auto` takes a GPU when one is present; `cuda` / `cuda:N` without that GPU
    is a UserError (one line, exit 2), raised before anything is loaded or written."""
    import re

    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), "auto: CUDA device found"
        return torch.device("cpu"), "auto: no CUDA device, using CPU"
    if name != "cpu" and not re.fullmatch(r"cuda(:\d+)?", name):
        raise UserError(f"unknown device {name!r}", "use auto, cpu, cuda or cuda:N")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {name} asked for but no CUDA device is available", "use --device cpu or auto")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)",
                            f"use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return torch.device(name), "asked for"


def resolve_dtype(name: str = "auto", device=None, source_dtype: str | None = None) -> torch.dtype:
    """The compute dtype for `--dtype NAME` on `device`. auto: the source's dtype (`source_dtype`, as
    io.dtypes.detect_source_dtype names it) on a GPU; float32 on the CPU, where bf16/fp16 math is slow
    (no native kernels on most CPUs) and inexact."""
    import torch

    if name not in DTYPE_CHOICES:
        raise UserError(f"unknown dtype {name!r}", f"use one of {', '.join(DTYPE_CHOICES)}")
    if name == "auto":
        on_gpu = device is not None and torch.device(device).type == "cuda"
        name = (source_dtype if source_dtype in DTYPES else "float32") if on_gpu else "float32"
    return getattr(torch, name)


def source_dtype_of_spec(spec: str) -> str:
    """The dtype a model spec (alias, directory, .gguf, hub id) is distributed in, without loading it."""
    from llmcompress.io.dtypes import detect_source_dtype
    from llmcompress.io.load import resolve

    return detect_source_dtype(*resolve(spec))


def resolve_compute(device: str = "auto", dtype: str = "auto", model: str | None = None) -> tuple[torch.device, torch.dtype]:
    """`--device` and `--dtype` of any command, resolved once at the edge: (torch.device, torch.dtype).
    `model` is read (its config only) only when dtype is auto on a GPU. Raises UserError."""
    if dtype not in DTYPE_CHOICES:  # both names checked before torch touches a device
        raise UserError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPE_CHOICES)}")
    dev, _ = resolve_device(device)
    source = source_dtype_of_spec(model) if (dtype == "auto" and dev.type == "cuda" and model is not None) else None
    return dev, resolve_dtype(dtype, dev, source)


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


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's `model name`, else what `platform` says), for reports and cache keys."""
    import platform
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "?"


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages as "a b c" (reported next to wall times), or "?"."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
