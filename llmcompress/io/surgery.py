"""Layer surgery that keeps a model correct.

After any change to the decoder layer list, three things must agree with the new list, or the KV cache,
generate() and a reload from disk silently break: `config.num_hidden_layers`, each layer's `layer_idx`
(the KV-cache slot it writes), and per-layer config lists such as `layer_types`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from llmcompress.errors import UserError
from llmcompress.io.adapters import get_adapter

if TYPE_CHECKING:
    import torch.nn as nn

# config attributes that hold one entry per decoder layer
PER_LAYER_CONFIG_LISTS = ("layer_types", "no_rope_layers", "mlp_layer_types")


def _per_layer_lists(config) -> dict[str, list]:
    n = config.num_hidden_layers
    out = {}
    for name in PER_LAYER_CONFIG_LISTS:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and len(value) == n:
            out[name] = list(value)
    return out


def _check_supported(model) -> None:
    if getattr(model.config, "scale_attn_by_inverse_layer_idx", False):
        raise UserError(
            "this GPT-2 config scales attention by layer index, so moving layers would change their math",
            "layer surgery needs scale_attn_by_inverse_layer_idx=False",
        )


def replace_layers(model: nn.Module, layers: Sequence[nn.Module], origin: Sequence[int]) -> nn.Module:
    """Install `layers` as the model's decoder layers, in place.

    Args:
        model: a causal LM served by an adapter.
        layers: the new decoder layers, in order (they may be original layers, copies or merged ones).
        origin: for each new layer, the index of the original layer whose per-layer config entries
            (e.g. `layer_types`) it inherits.
    """
    import torch.nn as nn

    if len(layers) != len(origin):
        raise ValueError("layers and origin must have the same length")
    if len(layers) < 1:
        raise UserError("a model needs at least one decoder layer", "keep one layer or more")
    _check_supported(model)
    adapter = get_adapter(model)
    config = model.config
    lists = _per_layer_lists(config)
    adapter.set_decoder_layers(model, nn.ModuleList(layers))
    for new_idx, layer in enumerate(layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_idx
    config.num_hidden_layers = len(layers)
    for name, values in lists.items():
        setattr(config, name, [values[i] for i in origin])
    return model


def _kept(model: nn.Module, keep: Sequence[int]) -> list:
    """The decoder layers at indices `keep`, in that order (an index out of range is a UserError)."""
    current = list(get_adapter(model).decoder_layers(model))
    n = len(current)
    bad = [i for i in keep if not 0 <= i < n]
    if bad:
        raise UserError(f"layer indices {bad} are out of range for a model with {n} layers", f"use 0..{n - 1}")
    return [current[i] for i in keep]


def keep_layers(model: nn.Module, keep: Sequence[int]) -> nn.Module:
    """Keep only the decoder layers at indices `keep` (in that order), in place."""
    return replace_layers(model, _kept(model, keep), list(keep))


def kept_copy(model: nn.Module, keep: Sequence[int]) -> nn.Module:
    """A deep copy of `model` with only the decoder layers at `keep` (as `keep_layers(copy.deepcopy(model), keep)`),
    made without ever copying the others: memory holds the original and the kept layers' copy, never a second
    whole model (a student derived from a 70B teacher). The original is unchanged."""
    import copy

    with swapped_layers(model, _kept(model, keep), list(keep)):  # config and layer_idx as keep_layers sets them
        return copy.deepcopy(model)


def remove_layers(model: nn.Module, drop: Sequence[int]) -> nn.Module:
    """Remove the decoder layers at indices `drop`, in place."""
    n = model.config.num_hidden_layers
    dropped = set(drop)
    bad = [i for i in dropped if not 0 <= i < n]
    if bad:
        raise UserError(f"layer indices {sorted(bad)} are out of range for a model with {n} layers", f"use 0..{n - 1}")
    return keep_layers(model, [i for i in range(n) if i not in dropped])


@contextmanager
def swapped_layers(model: nn.Module, layers: Sequence[nn.Module], origin: Sequence[int]):
    """Temporarily install `layers` (see `replace_layers`); everything is restored on exit."""
    adapter = get_adapter(model)
    config = model.config
    saved_layers = adapter.decoder_layers(model)
    saved_n = config.num_hidden_layers
    saved_lists = _per_layer_lists(config)
    saved_idx = [(m, m.layer_idx) for layer in saved_layers for m in layer.modules() if hasattr(m, "layer_idx")]
    saved_idx += [(m, m.layer_idx) for layer in layers for m in layer.modules() if hasattr(m, "layer_idx")]
    try:
        replace_layers(model, layers, origin)
        yield model
    finally:
        adapter.set_decoder_layers(model, saved_layers)
        config.num_hidden_layers = saved_n
        for name, values in saved_lists.items():
            setattr(config, name, values)
        for module, idx in saved_idx:
            module.layer_idx = idx


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose modules and config are new but whose parameters and buffers are the
    original's tensors (no second copy of the weights). Safe for structural edits (replacing layers or
    submodules, changing the config); an in-place write to a weight shows in both models."""
    import copy

    memo = {id(t): t for t in model.parameters()}
    memo.update({id(t): t for t in model.buffers()})
    return copy.deepcopy(model, memo)


def untie_output_(model) -> str:
    """Give a tied output matrix its own copy of the weights, in place (the config says untied, text config
    included); returns the head's module FQN."""
    import torch

    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for cfg in {id(c): c for c in (model.config, text)}.values():
        cfg.tie_word_embeddings = False
    return next(n for n, m in model.named_modules() if m is head)
