"""Load a packed NAS checkpoint (a directory holding `packed.json`): `load_packed(path, dtype)`.

The model is rebuilt from `config.json`, each layer's MLP is resized to its width from `packed.json`,
quantized weights are unpacked and dequantized (q - zero) * scale, other tensors are copied.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmcompress.errors import UserError

PACKED_MARKER = "packed.json"


def is_packed(path) -> bool:
    return (Path(path) / PACKED_MARKER).is_file()


def load_packed(path, dtype=None):
    """(model in eval mode, tokenizer or None) from a packed checkpoint directory."""
    import torch
    import torch.nn as nn
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from llmcompress.io.adapters import get_adapter
    from llmcompress.quant import primitives as P

    path = Path(path)
    if not is_packed(path):
        raise UserError(f"{path} is not a packed llmcompress checkpoint (no {PACKED_MARKER})", "pass the packed/ directory")
    marker = json.loads((path / PACKED_MARKER).read_text())
    dtype = dtype or torch.float32
    config = AutoConfig.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for layer, width in zip(get_adapter(model).decoder_layers(model), marker["mlp_widths"]):
        mlp = layer.mlp
        hidden = mlp.gate_proj.in_features
        mlp.gate_proj = nn.Linear(hidden, width, bias=mlp.gate_proj.bias is not None, dtype=dtype)
        mlp.up_proj = nn.Linear(hidden, width, bias=mlp.up_proj.bias is not None, dtype=dtype)
        mlp.down_proj = nn.Linear(width, hidden, bias=mlp.down_proj.bias is not None, dtype=dtype)
    tensors = load_file(str(path / "model.safetensors"))
    state = {}
    for fqn, meta in marker["quantized"].items():
        out, inp = meta["shape"]
        bits, gs = meta["bits"], meta["group_size"]
        q = P.unpack(tensors.pop(f"{fqn}.qweight"), bits, out * inp, (out, inp))
        zero = P.unpack(tensors.pop(f"{fqn}.qzeros"), bits, out * (inp // gs), (out, inp // gs))
        scale = tensors.pop(f"{fqn}.scales").float()
        state[f"{fqn}.weight"] = P.dequantize(q, scale, zero, gs).to(dtype)
    for name, t in tensors.items():
        state[name] = t.to(dtype) if t.is_floating_point() else t
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise UserError(f"packed checkpoint {path} does not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})",
                        "re-export it")
    if config.tie_word_embeddings:
        model.tie_weights()
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        tok = None
    if tok is not None and tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok
