"""One table of architecture adapters: uniform access to decoder layers, final norm, embeddings, head.

Adding an architecture is one entry in `ADAPTERS`. Everything else in llmcompress (surgery, collapse,
distill, nas) goes through an adapter and never names a model class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmcompress.errors import UnsupportedArchitecture

if TYPE_CHECKING:
    import torch.nn as nn


@dataclass(frozen=True)
class ArchAdapter:
    """How to reach the parts of one architecture family.

    Attributes:
        family: short family name written into manifests ("llama", "gpt2").
        model_types: HF `config.model_type` values served by this adapter.
        layers: dotted path of the decoder `ModuleList`.
        final_norm: dotted path of the norm applied after the last layer.
        embed: dotted path of the token embedding.
        lm_head: dotted path of the output projection.
        attention: attribute of a decoder layer holding the attention module (it carries `layer_idx`).
        kinds: parameter-name prefix inside a layer -> module kind ("attention", "mlp", "norm").
        position_embed: dotted path of learned absolute position embeddings (GPT-2), added to the
            input embeddings inside the model forward.
    """

    family: str
    model_types: tuple[str, ...]
    layers: str
    final_norm: str
    embed: str
    lm_head: str
    attention: str
    kinds: dict[str, str] = field(default_factory=dict)
    position_embed: str | None = None

    def get(self, model: nn.Module, path: str) -> nn.Module:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return self.get(model, self.layers)

    def set_decoder_layers(self, model: nn.Module, layers: nn.ModuleList) -> None:
        parent_path, _, name = self.layers.rpartition(".")
        setattr(self.get(model, parent_path) if parent_path else model, name, layers)

    def norm(self, model: nn.Module) -> nn.Module:
        return self.get(model, self.final_norm)

    def embeddings(self, model: nn.Module) -> nn.Module:
        return self.get(model, self.embed)

    def head(self, model: nn.Module) -> nn.Module:
        return self.get(model, self.lm_head)

    def kind_of(self, param_name: str) -> str:
        """Module kind of a parameter named relative to its decoder layer ("self_attn.q_proj.weight")."""
        for prefix, kind in self.kinds.items():
            if param_name.startswith(prefix):
                return kind
        return "other"


_LLAMA_KINDS = {
    "self_attn.": "attention",
    "mlp.": "mlp",
    "input_layernorm.": "norm",
    "post_attention_layernorm.": "norm",
}

ADAPTERS: tuple[ArchAdapter, ...] = (
    ArchAdapter(
        family="llama",
        model_types=("llama", "mistral", "qwen2", "qwen3"),
        layers="model.layers",
        final_norm="model.norm",
        embed="model.embed_tokens",
        lm_head="lm_head",
        attention="self_attn",
        kinds=_LLAMA_KINDS,
    ),
    ArchAdapter(
        family="gpt2",
        model_types=("gpt2",),
        layers="transformer.h",
        final_norm="transformer.ln_f",
        embed="transformer.wte",
        lm_head="lm_head",
        attention="attn",
        kinds={"attn.": "attention", "mlp.": "mlp", "ln_1.": "norm", "ln_2.": "norm"},
        position_embed="transformer.wpe",
    ),
)

SUPPORTED_MODEL_TYPES = tuple(t for a in ADAPTERS for t in a.model_types)


def adapter_for_type(model_type: str) -> ArchAdapter:
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    raise UnsupportedArchitecture(
        f"unsupported architecture {model_type!r}",
        f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}",
    )


def get_adapter(model_or_config) -> ArchAdapter:
    """The adapter for a model (or its config)."""
    config = getattr(model_or_config, "config", model_or_config)
    return adapter_for_type(getattr(config, "model_type", "unknown"))
