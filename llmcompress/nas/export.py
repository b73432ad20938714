"""Derive a physically smaller model from an `Arch`, quantize it by its plan, save packed + HF checkpoints.

* derive_model: copies the (channel-ranked) teacher, keeps the first `width` MLP channels of each kept
  layer (truly smaller tensors) and removes skipped layers with llmcompress.io.surgery.
* plan_of: the MixedPrecisionPlan (new module FQN -> bits, group size) of the derived model.
* quantize_derived: RTN-quantizes the planned linears (weights become their dequantized values) and
  rounds every other floating tensor to float16, exactly what the packed checkpoint stores.
* save_packed: integer weights (bit-packed) + float16 scales + packed zeros in safetensors, the plan in
  `packed.json` and in the manifest. Loaded by `llmcompress.nas.packed.load_packed`.
* save_hf: a dequantized checkpoint plain transformers loads. A LlamaConfig has one intermediate_size,
  so pruned MLP channels are zero-padded back to it: a zero row of gate/up and a zero column of down
  contribute exactly nothing, so outputs are the same as the sliced model's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn as nn

from llmcompress.io.adapters import get_adapter
from llmcompress.io.surgery import keep_layers
from llmcompress.nas.space import Arch, SearchSpace
from llmcompress.quant import primitives as P
from llmcompress.quant.apply import QuantizedWeight, quantize_model_
from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig

PACKED_MARKER = "packed.json"
PACKED_FORMAT = "llmcompress-packed-v1"


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
    """A copy of `teacher` with skipped layers removed and MLPs sliced to their widths."""
    model = copy.deepcopy(teacher)
    layers = get_adapter(model).decoder_layers(model)
    for i, layer in enumerate(layers):
        if arch.keep[i] and space.widths[arch.width[i]] < space.intermediate:
            slice_mlp_(layer, space.widths[arch.width[i]])
    keep_layers(model, [i for i in range(space.n_layers) if arch.keep[i]])
    return model.eval()


def plan_of(space: SearchSpace, arch: Arch) -> MixedPrecisionPlan:
    plan = MixedPrecisionPlan()
    new = 0
    for i in range(space.n_layers):
        if not arch.keep[i]:
            continue
        for name, b in zip(space.linears, arch.bits[i]):
            plan[space.fqn(new, name)] = QuantConfig(bits=space.bits[b], group_size=space.group_size)
        new += 1
    plan["_default"] = None  # embeddings, norms and head stay float16
    return plan


def mlp_widths(model) -> list[int]:
    return [layer.mlp.down_proj.in_features for layer in get_adapter(model).decoder_layers(model)]


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


def _unique_state(model) -> dict[str, torch.Tensor]:
    """State dict without tied duplicates (the first name of each storage wins)."""
    seen, out = set(), {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def save_packed(model, tokenizer, qweights: dict[str, QuantizedWeight], plan, out: Path, manifest: dict, overwrite=True) -> Path:
    """Write the packed checkpoint (see module docstring) atomically to `out`."""
    from safetensors.torch import save_file

    from llmcompress.io.atomic import atomic_dir, write_json
    from llmcompress.io.load import _drop_quantization_config

    _drop_quantization_config(model)
    tensors, qmeta = {}, {}
    for name, t in _unique_state(model).items():
        fqn = name[: -len(".weight")] if name.endswith(".weight") else None
        if fqn in qweights:
            qw = qweights[fqn]
            tensors[f"{fqn}.qweight"] = P.pack(qw.q, qw.bits)
            tensors[f"{fqn}.scales"] = qw.scale.to(torch.float16).contiguous()
            tensors[f"{fqn}.qzeros"] = P.pack(qw.zero, qw.bits)
            qmeta[fqn] = {"bits": qw.bits, "group_size": qw.group_size, "shape": list(qw.q.shape)}
        elif t.is_floating_point():
            tensors[name] = t.detach().to(torch.float16).contiguous()
        else:
            tensors[name] = t.detach().contiguous()
    marker = {"format": PACKED_FORMAT, "mlp_widths": mlp_widths(model), "quantized": qmeta, "plan": plan.to_dict(),
              "other_dtype": "float16"}
    with atomic_dir(Path(out), overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json(tmp / PACKED_MARKER, marker)
        from llmcompress.io.checkpoint import DIGESTS, file_digests

        write_json(tmp / "llmcompress.json", {**manifest, "plan": plan.to_dict(), "packed": True, DIGESTS: file_digests(tmp)})
        tmp.chmod(0o755)
    return Path(out)


def zero_padded(model, width: int):
    """A copy whose MLPs are zero-padded to `width` channels (outputs unchanged; plain HF loadable)."""
    import torch.nn as nn

    padded = copy.deepcopy(model)
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


def save_hf(model, tokenizer, out: Path, manifest: dict, intermediate: int, overwrite=True) -> Path:
    from llmcompress.io.checkpoint import save_checkpoint

    padded = zero_padded(model, intermediate)
    padded.config.intermediate_size = intermediate
    return save_checkpoint(padded, tokenizer, Path(out), manifest=manifest, overwrite=overwrite)
