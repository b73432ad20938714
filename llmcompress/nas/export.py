"""Derive a physically smaller model from an `Arch`, quantize it by its plan, save HF + deployable exports.

* derive_model: copies the (channel-ranked) teacher, keeps the first `width` MLP channels of each kept
  layer (truly smaller tensors) and removes skipped layers with llmcompress.io.surgery.
* plan_of: the MixedPrecisionPlan (new module FQN -> bits, group size) of the derived model.
* apply_bank: the pipeline's path: copies the search's own quantized weights (nas/qbank.py, sliced to the
  MLP widths) into the derived model, so the export is exactly the model the search and its validated step
  scored; every other tensor stays as it was.
* quantize_derived: RTN- or GPTQ-quantizes a derived model from scratch (callers without a bank; tests) and rounds every other floating tensor to float16.
* save_hf: a *dequantized* checkpoint for evaluation, which plain transformers loads (in the source dtype).
  A LlamaConfig has one intermediate_size, so pruned MLP channels are zero-padded back to it: a zero row
  of gate/up and a zero column of down contribute exactly nothing, so outputs equal the sliced model's.
* save_exports: the integer weights as GGUF (OUT/gguf/model.gguf) and compressed-tensors
  (OUT/compressed-tensors/), through llmcompress.export. Per-layer MLP widths are zero-padded there too
  (padding rows/groups hold q = z, so they dequantize to exactly 0 in both formats): the files are no
  smaller than a dense-width model at the same bits; llama.cpp's `deci` architecture (per-layer FFN
  sizes) would avoid that and is not used yet.

(The former `packed/` folder, a private bit stream that AutoModelForCausalLM opened as a silently wrong
model, is gone: GGUF and compressed-tensors replace it.)
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from llmcompress.io.adapters import get_adapter
from llmcompress.io.surgery import kept_copy
from llmcompress.nas.space import Arch, SearchSpace
from llmcompress.quant.apply import QuantizedWeight, quantize_model_
from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig


def _sliced(lin: nn.Linear, rows: int | None = None, cols: int | None = None) -> nn.Linear:
    W = lin.weight.data
    W = W[:rows] if rows is not None else W
    W = W[:, :cols] if cols is not None else W
    new = nn.Linear(W.shape[1], W.shape[0], bias=lin.bias is not None, dtype=W.dtype, device=W.device)
    new.weight.data.copy_(W)
    if lin.bias is not None:
        new.bias.data.copy_(lin.bias.data[:rows] if rows is not None else lin.bias.data)
    return new


def slice_mlp_(layer, width: int) -> None:
    mlp = layer.mlp
    mlp.gate_proj = _sliced(mlp.gate_proj, rows=width)
    mlp.up_proj = _sliced(mlp.up_proj, rows=width)
    mlp.down_proj = _sliced(mlp.down_proj, cols=width)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = width


def derive_model(teacher, space: SearchSpace, arch: Arch):
    """A copy of `teacher` with skipped layers removed and MLPs sliced to their widths (the skipped layers are
    never copied: `io.surgery.kept_copy`)."""
    kept = [i for i in range(space.n_layers) if arch.keep[i]]
    model = kept_copy(teacher, kept)
    layers = get_adapter(model).decoder_layers(model)
    for new, i in enumerate(kept):
        if space.widths[arch.width[i]] < space.intermediate:
            slice_mlp_(layers[new], space.widths[arch.width[i]])
    return model.eval()


def plan_of(space: SearchSpace, arch: Arch, sym8: bool = False, method: str = "rtn") -> MixedPrecisionPlan:
    """The derived model's plan; `sym8`: 8-bit layers symmetric (GGUF's Q8_0 is); 16-bit entries stay float."""
    plan = MixedPrecisionPlan()
    new = 0
    for i in range(space.n_layers):
        if not arch.keep[i]:
            continue
        for name, b in zip(space.linears, arch.bits[i]):
            bits = space.bits[b]
            plan[space.fqn(new, name)] = (None if bits >= 16 else
                                          QuantConfig(bits=bits, group_size=space.group_size, method=method, sym=sym8 and bits == 8))
        new += 1
    if arch.head is not None and space.head_bits[arch.head] < 16:  # a searched head (tied: the embedding too)
        bits = space.head_bits[arch.head]
        plan["lm_head"] = QuantConfig(bits=bits, group_size=space.group_size, method="rtn", sym=sym8 and bits == 8)
    plan["_default"] = None  # embeddings, norms and an unsearched head stay float16
    return plan


def mlp_widths(model) -> list[int]:
    return [layer.mlp.down_proj.in_features for layer in get_adapter(model).decoder_layers(model)]


def apply_bank(model, space: SearchSpace, arch: Arch, bank) -> dict[str, QuantizedWeight]:
    """Copy the bank's quantized weights of `arch` into its derived `model` (derive_model(teacher, space,
    arch)); returns the integer weights by the derived model's FQNs (16-bit choices stay float, absent)."""
    mods = dict(model.named_modules())
    out: dict[str, QuantizedWeight] = {}
    new = 0
    for i in range(space.n_layers):
        if not arch.keep[i]:
            continue
        width = space.widths[arch.width[i]]
        for j, name in enumerate(space.linears):
            qw = bank.qweight(i, j, arch.bits[i][j], width)
            lin = mods[space.fqn(new, name)]
            if qw is None:
                continue
            if tuple(qw.q.shape) != tuple(lin.weight.shape):
                raise ValueError(f"bank weight {tuple(qw.q.shape)} does not fit {space.fqn(new, name)} {tuple(lin.weight.shape)}")
            with torch.no_grad():
                lin.weight.copy_(qw.dequantize(lin.weight.dtype))
            out[space.fqn(new, name)] = qw
        new += 1
    if arch.head is not None:  # the searched head; a tied embedding is the same tensor, so it follows
        from llmcompress.nas.qbank import HEAD

        qw = bank.qweight(HEAD, 0, arch.head)
        if qw is not None:
            with torch.no_grad():
                head = model.get_output_embeddings().weight
                head.copy_(qw.dequantize(head.dtype))
            out["lm_head"] = qw
    return out


def quantize_derived(model, plan: MixedPrecisionPlan, method: str = "rtn", blocks=None, act_order: bool = False) -> dict[str, QuantizedWeight]:
    """Quantize the derived model by `plan` (rtn, or gptq with Hessians from `blocks`; `act_order`: see
    quant.gptq.gptq_quantize); the rest -> float16."""
    if method == "gptq":
        from llmcompress.quant.gptq import gptq_model_

        qweights = gptq_model_(model, plan, blocks, act_order=act_order)
    else:
        qweights = quantize_model_(model, plan)
    quantized = {f"{n}.weight" for n in qweights}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in quantized and p.is_floating_point():
                p.copy_(p.to(torch.float16).to(p.dtype))
    return qweights


def zero_padded(model, width: int):
    """A copy whose MLPs are zero-padded to `width` channels (outputs unchanged; plain HF loadable). Padded
    linears are new; every other tensor is shared with `model` (no second full copy)."""
    import torch.nn as nn

    from llmcompress.io.surgery import shared_copy

    padded = shared_copy(model)
    for layer in get_adapter(padded).decoder_layers(padded):
        mlp = layer.mlp
        w = mlp.down_proj.in_features
        if w == width:
            continue
        for attr in ("gate_proj", "up_proj"):
            old = getattr(mlp, attr)
            new = nn.Linear(old.in_features, width, bias=old.bias is not None, dtype=old.weight.dtype)
            with torch.no_grad():
                new.weight.zero_()
                new.weight[:w] = old.weight
                if old.bias is not None:
                    new.bias.zero_()
                    new.bias[:w] = old.bias
            setattr(mlp, attr, new)
        old = mlp.down_proj
        new = nn.Linear(width, old.out_features, bias=old.bias is not None, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.zero_()
            new.weight[:, :w] = old.weight
            if old.bias is not None:
                new.bias.copy_(old.bias)
        mlp.down_proj = new
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = width
    return padded


def save_hf(model, tokenizer, out: Path, manifest: dict, intermediate: int, overwrite=True, dtype: str | None = None) -> Path:
    from llmcompress.io.checkpoint import save_checkpoint

    padded = zero_padded(model, intermediate)
    padded.config.intermediate_size = intermediate
    manifest = {**manifest, "contents": "dequantized weights (for evaluation; deploy gguf/ or compressed-tensors/)"}
    return save_checkpoint(padded, tokenizer, Path(out), manifest=manifest, overwrite=overwrite, dtype=dtype)


def _pad_qweight(qw: QuantizedWeight, rows: int = 0, cols: int = 0) -> QuantizedWeight:
    """Append `rows` output rows / `cols` input columns that dequantize to exactly 0 (q = z, scale 1)."""
    z = 2 ** (qw.bits - 1) if qw.sym else 0
    q, s, zero = qw.q, qw.scale, qw.zero
    if rows:
        q = torch.cat([q, torch.full((rows, q.shape[1]), z, dtype=q.dtype)])
        s = torch.cat([s, torch.ones(rows, s.shape[1], dtype=s.dtype)])
        zero = torch.cat([zero, torch.full((rows, zero.shape[1]), z, dtype=zero.dtype)])
    if cols:
        if cols % qw.group_size:
            raise ValueError(f"padding of {cols} columns is not a whole number of groups of {qw.group_size}")
        g = cols // qw.group_size
        q = torch.cat([q, torch.full((q.shape[0], cols), z, dtype=q.dtype)], 1)
        s = torch.cat([s, torch.ones(s.shape[0], g, dtype=s.dtype)], 1)
        zero = torch.cat([zero, torch.full((zero.shape[0], g), z, dtype=zero.dtype)], 1)
    return QuantizedWeight(q, s, zero, qw.bits, qw.group_size, qw.sym)


def pad_qweights(model, qweights: dict[str, QuantizedWeight], intermediate: int) -> dict[str, QuantizedWeight]:
    """The integer weights of `zero_padded(model, intermediate)`."""
    out = dict(qweights)
    for i, layer in enumerate(get_adapter(model).decoder_layers(model)):
        extra = intermediate - layer.mlp.down_proj.in_features
        if not extra:
            continue
        pre = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj"):
            if pre + name in out:
                out[pre + name] = _pad_qweight(out[pre + name], rows=extra)
        if pre + "down_proj" in out:
            out[pre + "down_proj"] = _pad_qweight(out[pre + "down_proj"], cols=extra)
    return out


def untied(model):
    """A shallow copy of a tied `model` whose lm_head has its own copy of the weight (tie_word_embeddings off)."""
    from llmcompress.io.surgery import shared_copy, untie_output_

    new = shared_copy(model)
    untie_output_(new)
    return new


def save_exports(model, tokenizer, qweights: dict[str, QuantizedWeight], out: Path, formats, intermediate: int,
                 dtype: str, manifest: dict) -> dict:
    """Write each of `formats` (gguf, compressed-tensors) under `out`; returns {format: summary}."""
    padded = zero_padded(model, intermediate)
    padded.config.intermediate_size = intermediate
    head_q = "lm_head" in qweights and qweights["lm_head"].bits < 16
    # 16-bit entries of a plan stay floating point: their (dequantized) weights are written in `dtype`
    pq = pad_qweights(model, {k: q for k, q in qweights.items() if q.bits < 16}, intermediate)
    note = ("per-layer MLP widths zero-padded to " + str(intermediate)
            if any(w != intermediate for w in mlp_widths(model)) else "")
    res = {}
    for fmt in formats:
        if fmt == "gguf":
            from llmcompress.export.gguf import write_gguf

            r = write_gguf(padded, Path(out) / "gguf" / "model.gguf", qweights=pq, float_dtype=dtype, tokenizer=tokenizer,
                           name=f"llmcompress {manifest.get('method', 'nas')}", metadata={"method": manifest.get("method", "nas")},
                           overwrite=True)
        else:
            from llmcompress.export.compressed_tensors import write_compressed_tensors

            # compressed-tensors quantizes linears: a quantized tied head is written untied, lm_head packed
            # and the embedding table as its dequantized values (the same numbers, so the same model)
            ct = untied(padded) if head_q and padded.config.tie_word_embeddings else padded
            r = write_compressed_tensors(ct, tokenizer, Path(out) / "compressed-tensors", qweights=pq, float_dtype=dtype,
                                         manifest_extra={"nas": {k: v for k, v in manifest.items() if k != "environment"}},
                                         overwrite=True)
        if note:
            r["note"] = note
        res[fmt] = r
    return res
