"""Forward passes over parts of a model: boundary hidden states and runs from a layer onwards.

These let engines cache the original model's activations at layer boundaries once and then evaluate
candidates from their first changed layer, instead of recomputing the shared prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

from llmcompress.io.adapters import get_adapter
from llmcompress.io.surgery import swapped_layers

if TYPE_CHECKING:
    import torch
    import torch.nn as nn


def first_output(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class _ZeroPositions:
    """Stands in for learned position embeddings when the input already holds them."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def __call__(self, position_ids):
        import torch

        return torch.zeros((*position_ids.shape, self.dim), device=position_ids.device)


@contextmanager
def _no_position_embed(model):
    adapter = get_adapter(model)
    if adapter.position_embed is None:
        yield
        return
    parent_path, _, name = adapter.position_embed.rpartition(".")
    parent = adapter.get(model, parent_path)
    module = getattr(parent, name)
    zero = _ZeroPositions(module.embedding_dim)
    original_forward = module.forward
    module.forward = zero
    try:
        yield
    finally:
        module.forward = original_forward


def boundary_states(model: nn.Module, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Hidden states at every layer boundary, and the logits.

    Returns (states, logits) where states[i] is the input of decoder layer i and states[L] is the output
    of the last layer (before the final norm).
    """
    import torch

    adapter = get_adapter(model)
    layers = adapter.decoder_layers(model)
    states: list[torch.Tensor] = []
    hooks = [layers[0].register_forward_pre_hook(lambda m, args, kw: states.append(args[0] if args else kw["hidden_states"]), with_kwargs=True)]
    hooks += [layer.register_forward_hook(lambda m, a, out: states.append(first_output(out))) for layer in layers]
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return states, logits


def forward_with_hooks(model: nn.Module, blocks: torch.Tensor, hooks: list, batch: int = 2) -> int:
    """Run `model` (no grad, no cache) over `blocks` in batches, then remove `hooks` (also on error).
    Returns the number of tokens seen: the denominator of statistics the hooks accumulate."""
    import torch

    n = 0
    try:
        with torch.no_grad():
            for b in blocks.split(batch):
                model(input_ids=b, use_cache=False)
                n += b.numel()
    finally:
        for h in hooks:
            h.remove()
    return n


class _StopForward(Exception):
    pass


def run_layers(
    model: nn.Module,
    hidden: torch.Tensor,
    layers: Sequence[nn.Module],
    origin: Sequence[int] | None = None,
    *,
    output: str = "logits",
) -> torch.Tensor:
    """Run `layers` (then the final norm and head) on a boundary hidden state.

    Args:
        model: the model whose embeddings, norm and head frame the run.
        hidden: (B, T, H) hidden state entering `layers[0]` (a cached boundary state).
        layers: decoder layers to run in order.
        origin: original index of each layer (for per-layer config such as `layer_types`).
        output: "logits" for next-token logits, "hidden" for the state after the last layer, before the
            final norm.
    """
    adapter = get_adapter(model)
    if origin is None:
        origin = list(range(len(layers)))
    captured = {}
    hook = None
    if output == "hidden":

        def grab(module, args):
            captured["h"] = args[0]
            raise _StopForward

        hook = adapter.norm(model).register_forward_pre_hook(grab)
    try:
        with swapped_layers(model, list(layers), list(origin)), _no_position_embed(model):
            try:
                logits = model(inputs_embeds=hidden, use_cache=False).logits
            except _StopForward:
                return captured["h"]
    finally:
        if hook is not None:
            hook.remove()
    return logits


def grad_context(enabled: bool):
    import torch

    return nullcontext() if enabled else torch.no_grad()
