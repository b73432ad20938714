"""A collapse candidate run layer by layer over an `io.stream.LayerRunner` (models larger than memory).

`CollapsedRunner(runner, cand)` has the LayerRunner interface with the candidate's groups as its layers:
`layer(g)` loads the source layers of group g (streamed: from the safetensors files, freed on exit), builds
the collapsed layer with the operator's own `collapse_group`, and yields it; `run(g, layer, h)` runs it at
the position of its leader. So the engines written against a LayerRunner (`io.stream.boundary_walk`,
`streamed_nll`) score a candidate unchanged, and the fitness (collapse/fitness.py) runs a candidate's suffix
one group at a time over every calibration block. At any time memory holds the resident embedding and head,
the source layers of one group and its collapsed layer.

A source layer merged with every coefficient 0 (dropped) is never read: `merge_tensors` skips a zero
coefficient, so the leader stands in for it and the merged tensors are the same.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from llmcompress.collapse.operator import collapse_group
from llmcompress.collapse.space import Candidate

if TYPE_CHECKING:
    import torch


def read_sources(cand: Candidate, g: int) -> list[int]:
    """The source layers of group g whose tensors the collapsed layer needs: the leader and every merged
    layer with a non-zero coefficient for some module kind."""
    grp = cand.groups[g]
    alphas = cand.alpha_dicts(g)
    return [grp[0]] + [i for i, a in zip(grp[1:], alphas) if any(v != 0.0 for v in a.values())]


class CollapsedRunner:
    """The LayerRunner interface over candidate `cand`'s groups (see the module docstring)."""

    def __init__(self, runner, cand: Candidate) -> None:
        self.runner = runner
        self.cand = cand

    @property
    def n_layers(self) -> int:
        return len(self.cand.groups)

    @property
    def batch(self) -> int:
        return self.runner.batch

    @property
    def device(self):
        return self.runner.device

    @property
    def model(self):
        return self.runner.model

    @contextmanager
    def layer(self, g: int):
        """Group g's collapsed layer (its leader itself for a group of one); its sources freed on exit."""
        grp = self.cand.groups[g]
        with ExitStack() as stack:
            loaded = {i: stack.enter_context(self.runner.layer(i)) for i in read_sources(self.cand, g)}
            if len(grp) == 1:
                yield loaded[grp[0]]
                return
            sources = [loaded.get(i, loaded[grp[0]]) for i in grp]  # a dropped layer: never read (see above)
            built = collapse_group(sources, self.cand.alpha_dicts(g), self.runner.adapter.kind_of)
            try:
                yield built
            finally:
                del built

    def run(self, g: int, layer, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.run(self.cand.groups[g][0], layer, hidden)

    def embed(self, blocks: torch.Tensor) -> list[torch.Tensor]:
        return self.runner.embed(blocks)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.logits(hidden)


def run_groups(cr: CollapsedRunner, g_start: int, hidden: list[torch.Tensor], keep=(), context=None) -> tuple[list[torch.Tensor], dict]:
    """Run the per-batch states `hidden` (entering group `g_start`) through groups g_start.. of `cr`, one
    group over every batch before the next (each source layer read once). With `keep`, also the states
    entering those groups ({g: per-batch list}); `context()` wraps every layer run (autocast)."""
    import contextlib

    kept: dict[int, list] = {}
    for g in range(g_start, cr.n_layers):
        if g in keep:
            kept[g] = hidden
        with cr.layer(g) as layer, (context() if context is not None else contextlib.nullcontext()):
            hidden = [cr.run(g, layer, h) for h in hidden]
    return hidden, kept


__all__ = ["CollapsedRunner", "read_sources", "run_groups"]
