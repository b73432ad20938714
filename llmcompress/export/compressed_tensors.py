"""Write a quantized model as a compressed-tensors `pack-quantized` checkpoint (W4A16 / W8A16 style).

The directory is an ordinary HF checkpoint whose config.json carries a `quantization_config`
(quant_method "compressed-tensors", format "pack-quantized", one config group per (bits, group size,
symmetric) combination, targets = the exact module names), which transformers (through the
`compressed-tensors` package) and vLLM read. Each quantized linear `X` is stored as

    X.weight_packed  int32, our integers packed by compressed_tensors' own `pack_to_int32`
    X.weight_scale   (out, in/group): float16 in a float16 checkpoint, else float32 (our scales are float16
                     values; bfloat16 cannot hold them, and compressed-tensors multiplies in the scale's
                     dtype, where float32 makes (q - z) * s exact)
    X.weight_zero_point  asymmetric only: the zero points, packed with `pack_to_int32` along dim 0
    X.weight_shape   (out, in)

compressed-tensors' integers are signed: q_ct = q - 2**(bits-1), zp_ct = z - 2**(bits-1), and
W = (q_ct - zp_ct) * scale, the same number as ours, (q - z) * s. Symmetric weights have zp_ct = 0 and no
zero-point tensor. Other tensors (embeddings, norms, lm_head) are written in `float_dtype`.
vLLM casts scales to the model dtype on load: a bfloat16 model there rounds our scales to bfloat16
(transformers keeps them). transformers 5 with compressed-tensors 0.20 cannot load *asymmetric*
pack-quantized checkpoints (the zero-point shapes it allocates are unpacked: llm-compressor issue #1618);
the files are what compressed-tensors' own compressor writes, and its decompressor reads them back exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmcompress.quant.apply import QuantizedWeight


def quantization_config(qweights: dict[str, QuantizedWeight], model=None) -> dict:
    """The `quantization_config` dict (compressed-tensors' QuantizationConfig) for these weights."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    groups: dict[tuple, list[str]] = {}
    for fqn, qw in qweights.items():
        groups.setdefault((qw.bits, qw.group_size, bool(qw.sym)), []).append(fqn)
    config_groups = {}
    for i, ((bits, gs, sym), fqns) in enumerate(sorted(groups.items())):
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=gs)
        config_groups[f"group_{i}"] = QuantizationScheme(targets=sorted(fqns), weights=args)
    ignore = []
    if model is not None:
        import torch.nn as nn

        ignore = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in qweights]
    qc = QuantizationConfig(config_groups=config_groups, format="pack-quantized", quantization_status="compressed",
                            ignore=ignore)
    return qc.model_dump(exclude_none=True)


def compress_weight(qw: QuantizedWeight, scale_dtype=None) -> dict:
    """The pack-quantized tensors of one linear (see the module docstring)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    off = 1 << (qw.bits - 1)
    out = {
        "weight_packed": pack_to_int32((qw.q - off).to(torch.int8), qw.bits),
        "weight_scale": qw.scale.to(scale_dtype or torch.float32).contiguous(),
        "weight_shape": torch.tensor(list(qw.q.shape), dtype=torch.int64),
    }
    if not qw.sym:
        out["weight_zero_point"] = pack_to_int32((qw.zero - off).to(torch.int8), qw.bits, packed_dim=0).contiguous()
    return out


def write_compressed_tensors(model, tokenizer, out: Path, *, qweights: dict[str, QuantizedWeight],
                             float_dtype: str = "bfloat16", manifest_extra: dict | None = None,
                             overwrite: bool = False) -> dict:
    """Write the checkpoint directory `out` atomically. Returns {path, bytes, quantized, float_dtype}."""
    import torch
    from safetensors.torch import save_file

    from llmcompress.io.atomic import atomic_dir, write_json
    from llmcompress.io.dtypes import torch_dtype
    from llmcompress.io.load import drop_quantization_config

    dt = torch_dtype(float_dtype)
    drop_quantization_config(model)
    tensors: dict[str, torch.Tensor] = {}
    seen = set()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        fqn = name.rsplit(".", 1)[0]
        if tied and name == "lm_head.weight":
            continue
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        if name.endswith(".weight") and fqn in qweights:
            for k, v in compress_weight(qweights[fqn], torch.float16 if dt == torch.float16 else torch.float32).items():
                tensors[f"{fqn}.{k}"] = v
        else:
            tensors[name] = t.detach().to(dt).contiguous() if t.is_floating_point() else t.detach().contiguous()
    qcfg = quantization_config(qweights, model)
    with atomic_dir(Path(out), overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config["dtype"] = float_dtype
        config["architectures"] = [type(model).__name__]
        config.pop("torch_dtype", None)
        config["quantization_config"] = qcfg
        write_json(tmp / "config.json", config)
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        nbytes = (tmp / "model.safetensors").stat().st_size
        manifest = {"format": "compressed-tensors/pack-quantized", "bytes_on_disk": nbytes,
                    "parameters": sum(p.numel() for p in model.parameters()), **(manifest_extra or {})}
        write_json(tmp / "llmcompress.json", manifest)
    return {"path": str(out), "bytes": nbytes, "quantized": len(qweights), "float_dtype": float_dtype}


__all__ = ["compress_weight", "quantization_config", "write_compressed_tensors"]
