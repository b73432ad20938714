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
        _write_config(tmp, model, tokenizer, float_dtype, qcfg)
        nbytes = (tmp / "model.safetensors").stat().st_size
        manifest = {"format": "compressed-tensors/pack-quantized", "bytes_on_disk": nbytes,
                    "parameters": sum(p.numel() for p in model.parameters()), **(manifest_extra or {})}
        write_json(tmp / "llmcompress.json", manifest)
    return {"path": str(out), "bytes": nbytes, "quantized": len(qweights), "float_dtype": float_dtype}


__all__ = ["compress_weight", "quantization_config", "write_compressed_tensors", "write_compressed_tensors_streamed"]


def write_compressed_tensors_streamed(runner, tokenizer, out: Path, *, plan, quant: str = "rtn", blocks=None,
                                      act_order: bool = False, float_dtype: str = "bfloat16",
                                      manifest_extra: dict | None = None, overwrite: bool = False,
                                      progress: bool = True) -> dict:
    """`write_compressed_tensors` for a model streamed layer by layer (`io.stream.LayerRunner.open`): each
    decoder layer is loaded, quantized (RTN, or GPTQ with its own Hessians, `quant.gptq.gptq_layerwise_`)
    and written as its own shard, then freed; the embedding, final norm and head go to a last shard, and
    `model.safetensors.index.json` maps every tensor to its shard (the sharded layout transformers and
    vLLM read). The tensors equal those `write_compressed_tensors` writes for the same model in memory.
    Under torchrun (GPTQ spread over the ranks, quant/gptq.py) only rank 0 writes; the others quantize their share."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from llmcompress.io.atomic import atomic_dir, write_json
    from llmcompress.io.dtypes import torch_dtype
    from llmcompress.quant import primitives as P
    from llmcompress.quant.apply import QuantizedWeight, linear_fqns

    dt = torch_dtype(float_dtype)
    scale_dtype = torch.float16 if dt == torch.float16 else torch.float32
    model = runner.model
    n = runner.n_layers
    shard = [f"model-{k + 1:05d}-of-{n + 1:05d}.safetensors" for k in range(n + 1)]
    weight_map: dict[str, str] = {}
    meta: dict[str, SimpleNamespace] = {}  # per quantized linear: bits, group size, sym (for the config)
    nbytes = 0
    targets = plan.quantized(linear_fqns(model))
    params = 0

    def floats(prefix: str, module, skip: set[str]) -> dict:
        tensors = {}
        for name, t in module.state_dict().items():
            full = f"{prefix}{name}"
            if full.rsplit(".", 1)[0] in skip and name.endswith("weight"):
                continue
            tensors[full] = t.detach().to(dt).contiguous() if t.is_floating_point() else t.detach().contiguous()
        return tensors

    from llmcompress.dist import world

    gptq = quant == "gptq" and blocks is not None  # GPTQ with nothing to quantize has no calibration blocks

    def run_gptq(sink):
        from llmcompress.quant.gptq import gptq_layerwise_

        gptq_layerwise_(runner, plan, blocks, act_order=act_order, sink=sink, progress=progress)

    if not world().is_main:
        if gptq:
            run_gptq(lambda i, qweights: None)
        return {}
    with atomic_dir(Path(out), overwrite=overwrite) as tmp:
        def sink(i, qweights):
            nonlocal nbytes, params
            prefix = runner.layer_prefix(i)
            layer = runner.adapter.decoder_layers(model)[i]
            params += sum(p.numel() for p in layer.parameters())
            tensors = floats(prefix, layer, set(qweights))
            for fqn, qw in qweights.items():
                for k, v in compress_weight(qw, scale_dtype).items():
                    tensors[f"{fqn}.{k}"] = v
                meta[fqn] = SimpleNamespace(bits=qw.bits, group_size=qw.group_size, sym=qw.sym)
            save_file(tensors, str(tmp / shard[i]), metadata={"format": "pt"})
            weight_map.update({k: shard[i] for k in tensors})
            nbytes += (tmp / shard[i]).stat().st_size

        if gptq:
            run_gptq(sink)
        else:
            from llmcompress.progress import track

            steps = range(n)
            for i in track(steps, "quantizing (RTN, layer by layer)", total=n) if progress else steps:
                with runner.layer(i) as layer:
                    got = {}
                    prefix = runner.layer_prefix(i)
                    for fqn, cfg in targets.items():
                        if fqn.startswith(prefix):
                            q, s, z = P.quantize(layer.get_submodule(fqn[len(prefix):]).weight.data, cfg.bits, cfg.group_size, sym=cfg.sym)
                            got[fqn] = QuantizedWeight(q.cpu(), s.cpu(), z.cpu(), cfg.bits, cfg.group_size, cfg.sym)
                    sink(i, got)
        # everything outside the decoder layers, as write_compressed_tensors writes it (a tied head once)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        layers_prefix = runner.adapter.layers + "."
        rest = {}
        for name, t in model.state_dict().items():
            if name.startswith(layers_prefix) or (tied and name == "lm_head.weight") or t.device.type == "meta":
                continue
            rest[name] = t.detach().to(dt).contiguous() if t.is_floating_point() else t.detach().contiguous()
            params += t.numel()
        save_file(rest, str(tmp / shard[n]), metadata={"format": "pt"})
        weight_map.update({k: shard[n] for k in rest})
        nbytes += (tmp / shard[n]).stat().st_size
        write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": nbytes}, "weight_map": weight_map})
        _write_config(tmp, model, tokenizer, float_dtype, quantization_config(meta, model))
        manifest = {"format": "compressed-tensors/pack-quantized", "bytes_on_disk": nbytes, "parameters": params,
                    "streamed": True, **(manifest_extra or {})}
        write_json(tmp / "llmcompress.json", manifest)
        tmp.chmod(0o755)
    return {"path": str(out), "bytes": nbytes, "quantized": len(meta), "float_dtype": float_dtype, "streamed": True}


def _write_config(tmp: Path, model, tokenizer, float_dtype: str, qcfg: dict) -> None:
    """config.json with the `quantization_config` transformers and vLLM read, the generation config and the
    tokenizer: the same for the in-memory and the streamed writer."""
    from llmcompress.io.atomic import write_json

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
