"""Cost models: modeled latency (lookup table measured here, or analytic bytes per decoded token),
packed size in MB, and average bits. All share one additive form, so expectations under independent
choice distributions are exact and differentiable:

    cost(arch) = fixed + sum_l keep_l * (layer_const + sum_lin A[lin][width_l] * B[bits_lin])

* lut: A = decode-time (batch 1, one token) of that linear at that width, measured with F.linear on this
  machine; layer_const = per-layer decode time minus its linears; fixed = embeddings + final norm + head.
  Per-layer and fixed times come from timing the real model's decode with all and with half the layers.
  B = 1: this CPU build has no low-bit kernels (weights are dequantized and run in float32), so bit width
  does not change measured time here. The lut is saved to `lut.json` in the run directory.
* measured (nas/measured.py): seconds per decoded token in llama.cpp of the GGUF export, from a table of
  probe GGUFs timed on this machine: C[lin][b] = time of that linear's shape in the ggml type of b bits
  (width-free: GGUF exports zero-pad MLPs), fixed = the float output matrix and the rest.
* analytic: bytes read per decoded token (memory-bound decode): A = weight count at that width,
  B = (bits + (16 + bits) / group_size) / 8 bytes per weight (packed ints + fp16 scale + packed zero;
  2 bytes for a 16-bit choice, which stays float16),
  layer_const = KV-cache bytes read at `context_len` + norms, fixed = float16 head (+ final norm); a
  searched head (`head_bits`) costs H[b] = its weights at b bits instead.
Latencies are relative to the dense float16 model under the same model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmcompress.nas.space import Arch, SearchSpace

if TYPE_CHECKING:
    import torch


@dataclass
class Additive:
    """fixed + H[head bits] + sum_l keep_l * (layer_const + sum_lin (A[lin][w_l] * B[b] + C[lin][b]))."""

    fixed: float
    layer_const: float
    A: dict[str, list[float]]  # linear name -> value per width index
    B: list[float]  # per bits index
    C: dict[str, list[float]] | None = field(default=None)  # linear name -> value per bits index (width-free)
    H: list[float] | None = field(default=None)  # per head bits index (space.head_bits), when the head is searched

    def of(self, space: SearchSpace, arch: Arch) -> float:
        total = self.fixed + (self.H[arch.head] if self.H is not None and arch.head is not None else 0.0)
        for i in range(space.n_layers):
            if arch.keep[i]:
                total += self.layer_const + sum(self.A[n][arch.width[i]] * self.B[b] for n, b in zip(space.linears, arch.bits[i]))
                if self.C is not None:
                    total += sum(self.C[n][b] for n, b in zip(space.linears, arch.bits[i]))
        return total

    def expected(self, space: SearchSpace, p_keep, p_width, p_bits, p_head=None) -> torch.Tensor:
        """E[cost] for probabilities p_keep (L,), p_width (L, K), p_bits (L, n_lin, nb), p_head (nh,)."""
        import torch

        A = torch.tensor([self.A[n] for n in space.linears], dtype=torch.float32)  # (n_lin, K)
        B = torch.tensor(self.B, dtype=torch.float32)  # (nb,)
        ea = p_width @ A.T  # (L, n_lin)
        eb = p_bits @ B  # (L, n_lin)
        per_layer = self.layer_const + (ea * eb).sum(-1)
        if self.C is not None:
            C = torch.tensor([self.C[n] for n in space.linears], dtype=torch.float32)  # (n_lin, nb)
            per_layer = per_layer + (p_bits * C).sum((-1, -2))
        out = self.fixed + (p_keep * per_layer).sum()
        if self.H is not None and p_head is not None:
            out = out + (p_head * torch.tensor(self.H, dtype=torch.float32)).sum()
        return out


def _numel_table(space: SearchSpace) -> dict[str, list[float]]:
    return {n: [float(space.shape(n, w)[0] * space.shape(n, w)[1]) for w in space.widths] for n in space.linears}


def _byte_factors(space: SearchSpace, bits: list[int] | None = None) -> list[float]:
    """Bytes per weight at each bit width (default space.bits): packed ints + float16 scale + packed zero per
    group; a 16-bit choice is the plain float16 weight (2 bytes, no scales: never more than dense)."""
    return [2.0 if b >= 16 else (b + (16 + b) / space.group_size) / 8 for b in (space.bits if bits is None else bits)]


def _head_numel(space: SearchSpace) -> float:
    return float(space.head_shape[0] * space.head_shape[1])


def _head_bytes(space: SearchSpace) -> list[float] | None:
    """Bytes of the searched head at each of space.head_bits (None: the head is not searched)."""
    return [_head_numel(space) * f for f in _byte_factors(space, space.head_bits)] if space.head_bits else None


class CostModels:
    """latency (relative to dense), size_mb and average bits of an architecture, exact and expected."""

    def __init__(self, space: SearchSpace, latency: Additive, latency_dense: float, size: Additive, kind: str, lut: dict | None = None):
        self.space, self.latency, self.latency_dense, self.size, self.kind, self.lut = space, latency, latency_dense, size, kind, lut
        self.table: dict | None = None  # the llama.cpp latency table of kind "measured"
        numel = _numel_table(space)
        # a searched head counts in the average like any linear (its 16-bit choice as 16 bits per weight)
        hn = _head_numel(space)
        self.bits_num = Additive(0.0, 0.0, numel, [float(b) for b in space.bits], H=[hn * b for b in space.head_bits] or None)
        self.bits_den = Additive(0.0, 0.0, numel, [1.0] * len(space.bits), H=[hn] * len(space.head_bits) or None)

    def metrics(self, arch: Arch) -> dict[str, float]:
        s = self.space
        return {
            "latency": self.latency.of(s, arch) / self.latency_dense,
            "size_mb": self.size.of(s, arch) / 1e6,
            "bits": self.bits_num.of(s, arch) / max(self.bits_den.of(s, arch), 1.0),
        }

    def expected(self, p_keep, p_width, p_bits, p_head=None) -> dict[str, torch.Tensor]:
        s = self.space
        a = (s, p_keep, p_width, p_bits, p_head)
        return {
            "latency": self.latency.expected(*a) / self.latency_dense,
            "size_mb": self.size.expected(*a) / 1e6,
            "bits": self.bits_num.expected(*a) / self.bits_den.expected(*a).clamp(min=1.0),
        }

    def minimum(self) -> dict[str, float]:
        """Smallest value of each metric the space reaches (each on its own)."""
        s = self.space
        low = Arch([True] * s.n_layers, [0] * s.n_layers, [[0] * len(s.linears) for _ in range(s.n_layers)], 0 if s.head_bits else None)
        # the cheapest layers to keep are all equal here, so keep the first min_keep
        low.keep = [i < s.min_keep for i in range(s.n_layers)]
        m = self.metrics(low)
        m["bits"] = float(min(s.bits))
        if s.head_bits:  # the average is monotone in the head's share of the weights: one of the two extremes
            m["bits"] = min(self.metrics(low)["bits"], self.metrics(Arch.dense(s, 0).copy_with_head(0))["bits"])
        return m


def _other_params(model, space: SearchSpace) -> tuple[float, float]:
    """(fixed parameter count outside decoder layers, per-layer non-linear parameter count)."""
    from llmcompress.io.adapters import get_adapter

    adapter = get_adapter(model)
    layer = adapter.decoder_layers(model)[0]
    lin = {f"{n}.weight" for n in space.linears}
    per_layer = sum(p.numel() for n, p in layer.named_parameters() if n not in lin)
    seen, fixed = set(), 0
    for name, p in model.named_parameters():
        if name.startswith(space.layers_path + ".") or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        fixed += p.numel()
    return float(fixed), float(per_layer)


def size_model(model, space: SearchSpace) -> Additive:
    """Bytes of the packed checkpoint: quantized linears (and head, when searched) + float16 everything else
    (a tied head is the embedding: counted once)."""
    fixed, per_layer = _other_params(model, space)
    head = _head_bytes(space)
    if head is not None:
        fixed -= _head_numel(space)
    return Additive(2 * fixed, 2 * per_layer, _numel_table(space), _byte_factors(space), H=head)


def analytic_latency(model, space: SearchSpace, context_len: int) -> tuple[Additive, float]:
    """Bytes moved per decoded token, and the dense float16 model's bytes."""
    cfg = model.config
    head = float(cfg.vocab_size * cfg.hidden_size)
    kv_dim = space.shapes["self_attn.k_proj"][0]
    _, per_layer = _other_params(model, space)
    layer_const = 2.0 * 2 * context_len * kv_dim + 2 * per_layer
    model_ = Additive(0.0 if space.head_bits else 2 * head, layer_const, _numel_table(space), _byte_factors(space), H=_head_bytes(space))
    dense_lin = sum(v[-1] for v in _numel_table(space).values()) * 2.0
    return model_, 2 * head + space.n_layers * (layer_const + dense_lin)


# ---- lookup table measured on this machine -----------------------------------------------------------


def _time(fn, repeats: int, inner: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return min(samples)  # the CPU is shared: the fastest run is the least disturbed


def _decode_time(model, context_len: int, tokens: int = 8, repeats: int = 3) -> float:
    import torch

    from llmcompress.eval.speed import cache_kwarg, cache_of

    ids = torch.randint(10, model.config.vocab_size, (1, context_len), generator=torch.Generator().manual_seed(0))
    kw = cache_kwarg(model)
    samples = []
    with torch.no_grad():
        for _ in range(repeats):
            out = model(input_ids=ids, use_cache=True)
            cache, nxt = cache_of(out), out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(tokens):
                out = model(input_ids=nxt, **{kw: cache}, use_cache=True)
                cache, nxt = cache_of(out), out.logits[:, -1:].argmax(-1)
            samples.append((time.perf_counter() - t0) / tokens)
    return min(samples)


def measure_lut(model, space: SearchSpace, context_len: int) -> dict:
    """Decode-time table (seconds per token) for this machine; see the module docstring."""
    import torch
    import torch.nn.functional as F

    from llmcompress.io.adapters import get_adapter
    from llmcompress.io.surgery import swapped_layers
    from llmcompress.progress import bar

    layers = list(get_adapter(model).decoder_layers(model))
    n, half = len(layers), len(layers) // 2
    with bar("measuring latency table", total=2 + len(space.linears)) as b:
        t_full = _decode_time(model, context_len)
        b.advance()
        with swapped_layers(model, layers[:half], list(range(half))):
            t_half = _decode_time(model, context_len)
        b.advance()
        per_layer = max((t_full - t_half) / (n - half), 1e-7)
        fixed = max(t_full - n * per_layer, 0.0)
        A = {}
        with torch.no_grad():
            for name in space.linears:
                row = []
                for w in space.widths:
                    out, inp = space.shape(name, w)
                    W, x = torch.randn(out, inp), torch.randn(1, inp)
                    row.append(_time(lambda W=W, x=x: F.linear(x, W), repeats=5, inner=50))
                A[name] = row
                b.advance()
    full_lin = sum(v[-1] for v in A.values())
    layer_const = max(per_layer - full_lin, 0.1 * per_layer)
    return {"fixed": fixed, "layer_const": layer_const, "A": A, "t_full": t_full, "t_half": t_half,
            "per_layer": per_layer, "context_len": context_len, "threads": torch.get_num_threads()}


def lut_latency(space: SearchSpace, lut: dict) -> tuple[Additive, float]:
    A = {n: list(lut["A"][n]) for n in space.linears}
    model_ = Additive(lut["fixed"], lut["layer_const"], A, [1.0] * len(space.bits))
    dense = lut["fixed"] + space.n_layers * (lut["layer_const"] + sum(v[-1] for v in A.values()))
    return model_, dense


def build_cost_models(model, space: SearchSpace, kind: str, context_len: int, lut: dict | None = None, *,
                      tokenizer=None, float_dtype: str = "bfloat16") -> CostModels:
    """Cost models for `kind` ("lut" measures the table unless given one; "measured" reads the cached
    llama.cpp table or measures it, with `tokenizer` for the probe GGUFs)."""
    if kind == "measured":
        from llmcompress.nas import measured as M

        ftype = M.float_type(float_dtype)
        table = M.measure_table(model.config, tokenizer, ftype=ftype)
        lat, dense = M.measured_latency(model, space, table, ftype)
        cm = CostModels(space, lat, dense, size_model(model, space), kind, None)
        cm.table = table
        return cm
    if kind == "lut":
        lut = lut or measure_lut(model, space, context_len)
        lat, dense = lut_latency(space, lut)
    else:
        lat, dense = analytic_latency(model, space, context_len)
    return CostModels(space, lat, dense, size_model(model, space), kind, lut)
