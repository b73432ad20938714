"""Group-wise asymmetric uniform quantization, bit packing and straight-through fake quantization.

Conventions (shared by the in-memory quantized model and the packed checkpoint, so both give the same
numbers bit for bit):
    weight W: (out, in); groups of `group_size` consecutive input columns per output row.
    scale s: (out, in // group_size), stored as float16 (rounded before it is used).
    zero z: (out, in // group_size), an integer in [0, 2**bits - 1] (stored packed at `bits` bits).
    q = clamp(round(W / s) + z, 0, 2**bits - 1);  W_hat = (q - z) * s   (computed in float32).
    symmetric (`sym=True`): z = 2**(bits-1) for every group and s = absmax / ((2**bits - 1) / 2) (the
    AutoGPTQ / compressed-tensors convention), so W_hat = s * (q - 2**(bits-1)), q in [0, 2**bits - 1]:
    exactly ggml's Q4_0 (d * (q - 8)), Q5_0 (d * (q - 16)) and, with q - 128 as int8, Q8_0 (d * q).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MIN_BITS, MAX_BITS = 2, 16


def check_bits(bits: int) -> None:
    if not (isinstance(bits, int) and MIN_BITS <= bits <= MAX_BITS):
        raise ValueError(f"bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out, inp = w.shape
    if inp % group_size:
        raise ValueError(f"group size {group_size} does not divide the input width {inp}")
    return w.reshape(out, inp // group_size, group_size)  # (out, G, gs)


def quant_params(w: torch.Tensor, bits: int, group_size: int, sym: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (scale, zero) of asymmetric min/max quantization (symmetric absmax with `sym`).

    Returns scale (out, G) float32 holding float16-representable values, and zero (out, G) int32.
    """
    import torch

    check_bits(bits)
    g = _grouped(w.detach().float(), group_size)
    qmax = 2**bits - 1
    if sym:
        absmax = g.abs().amax(-1)
        scale = (2 * absmax / qmax).clamp(min=1e-8)
        s16 = scale.to(torch.float16)
        s16 = torch.where(s16.float() < scale, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
        scale = s16.float().clamp(min=float(torch.finfo(torch.float16).tiny))
        return scale, torch.full_like(scale, 2 ** (bits - 1), dtype=torch.int32)
    lo = g.amin(-1).clamp(max=0.0)  # include 0 so that zero is exactly representable
    hi = g.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / qmax).clamp(min=1e-8)
    # round the scale *up* to a float16 value, so that the top of the range is never clipped
    s16 = scale.to(torch.float16)
    s16 = torch.where(s16.float() < scale, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    scale = s16.float().clamp(min=float(torch.finfo(torch.float16).tiny))
    zero = torch.round(-lo / scale).clamp(0, qmax).to(torch.int32)
    return scale, zero


def quantize(w: torch.Tensor, bits: int, group_size: int, scale=None, zero=None, sym: bool = False):
    """Round-to-nearest. Returns (q int32 (out, in), scale (out, G) float32, zero (out, G) int32)."""
    import torch

    if scale is None or zero is None:
        scale, zero = quant_params(w, bits, group_size, sym)
    g = _grouped(w.detach().float(), group_size)
    q = torch.round(g / scale[..., None]) + zero[..., None]
    q = q.clamp(0, 2**bits - 1).to(torch.int32)
    return q.reshape(w.shape), scale, zero


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, dtype=None) -> torch.Tensor:
    """(q - z) * s, group-wise; returns float32 (or `dtype`) of q's shape."""
    import torch

    g = _grouped(q, group_size).float()
    w = (g - zero.float()[..., None]) * scale.float()[..., None]
    return w.reshape(q.shape).to(dtype or torch.float32)


def quantize_dequantize(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """W_hat = dequantize(quantize(W)), in W's dtype."""
    q, s, z = quantize(w, bits, group_size)
    return dequantize(q, s, z, group_size).to(w.dtype)


class _RoundSTE:
    """Straight-through estimator: forward is quantize-dequantize, backward is the identity."""

    @staticmethod
    def apply(w, bits, group_size):
        w_hat = quantize_dequantize(w, bits, group_size)
        return w + (w_hat - w).detach()


def fake_quant(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Quantize-dequantize with straight-through gradients (dL/dW passes unchanged)."""
    return _RoundSTE.apply(w, bits, group_size)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||ref - approx||)."""
    import torch

    noise = torch.linalg.vector_norm((ref - approx).float())
    signal = torch.linalg.vector_norm(ref.float())
    return float("inf") if noise == 0 else float(20 * torch.log10(signal / noise))


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ints < 2**bits into a flat uint8 bitstream (little-endian bit order); exact."""
    import torch

    check_bits(bits)
    flat = q.reshape(-1).to(torch.int64)
    shifts = torch.arange(bits, dtype=torch.int64)
    bitplanes = ((flat[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)  # (n * bits,)
    pad = (-bitplanes.numel()) % 8
    if pad:
        bitplanes = torch.cat([bitplanes, bitplanes.new_zeros(pad)])
    weights = (1 << torch.arange(8, dtype=torch.int64)).to(torch.uint8)
    return (bitplanes.reshape(-1, 8).to(torch.int64) * weights.to(torch.int64)).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, numel: int, shape=None) -> torch.Tensor:
    """Inverse of `pack`: int32 tensor of `numel` values (reshaped to `shape` if given)."""
    import torch

    check_bits(bits)
    b = packed.reshape(-1).to(torch.int64)
    bitplanes = ((b[:, None] >> torch.arange(8, dtype=torch.int64)) & 1).reshape(-1)[: numel * bits]
    vals = (bitplanes.reshape(numel, bits) << torch.arange(bits, dtype=torch.int64)).sum(-1).to(torch.int32)
    return vals.reshape(shape) if shape is not None else vals


def packed_nbytes(numel: int, bits: int) -> int:
    return math.ceil(numel * bits / 8)


def quantized_nbytes(out_features: int, in_features: int, bits: int, group_size: int) -> int:
    """Bytes on disk of one quantized weight: packed ints + float16 scales + packed zeros."""
    n_groups = out_features * (in_features // group_size)
    return packed_nbytes(out_features * in_features, bits) + 2 * n_groups + packed_nbytes(n_groups, bits)
