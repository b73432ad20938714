"""A collapse candidate run layer by layer over an `io.stream.LayerRunner` (models larger than memory).

`CollapsedRunner(runner, cand)` has the LayerRunner interface with the candidate's groups as its layers:
`layer(g)` builds group g's collapsed layer from its source layers with the operator's own arithmetic
(streamed: the leader loaded from the safetensors files and merged in place, `merge_group_`, the other
sources read one tensor at a time; in memory: `collapse_group`) and yields it; `run(g, layer, h)` runs it at
the position of its leader. So the engines written against a LayerRunner (`io.stream.boundary_walk`,
`streamed_nll`) score a candidate unchanged, and the fitness (collapse/fitness.py) runs a candidate's suffix
one group at a time over every calibration block. At any time memory holds the resident embedding and head,
one decoder layer (a group's leader, merged in place) and, while it is built, a few single tensors.

A source layer merged with every coefficient 0 (dropped) is never read: the merge skips a zero
coefficient, so the merged tensors are the same without it.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from llmcompress.collapse.operator import collapse_group, merge_group_
from llmcompress.collapse.space import Candidate

if TYPE_CHECKING:
    import torch


def read_sources(cand: Candidate, g: int) -> list[int]:
    """The source layers of group g whose tensors the collapsed layer needs: the leader and every merged
    layer with a non-zero coefficient for some module kind."""
    grp = cand.groups[g]
    alphas = cand.alpha_dicts(g)
    return [grp[0]] + [i for i, a in zip(grp[1:], alphas) if any(v != 0.0 for v in a.values())]


class _Tensors:
    """Decoder layer i's tensors by name relative to the layer, each read from the files when asked for."""

    def __init__(self, runner, i: int) -> None:
        self.runner, self.prefix = runner, runner.layer_prefix(i)

    def __getitem__(self, name: str):
        return self.runner.read_tensor(self.prefix + name)


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
        """Group g's collapsed layer (its leader itself for a group of one), with the operator's arithmetic
        (`merge_group_`, so the values equal the in-memory build). Streamed: the leader, loaded fresh, is
        merged in place, the leader's original values and the other sources read one tensor at a time (one
        layer and a few tensors resident); in memory: `collapse_group` on the resident layers."""
        grp = self.cand.groups[g]
        needed = read_sources(self.cand, g)  # a dropped layer (every coefficient 0) is never read
        if len(grp) > 1 and self.runner.streamed:
            import torch

            pairs = [(i, a) for i, a in zip(grp[1:], self.cand.alpha_dicts(g)) if i in needed]
            with self.runner.layer(grp[0]) as built:
                with torch.no_grad():
                    merge_group_(built.state_dict(), _Tensors(self.runner, grp[0]), [_Tensors(self.runner, i) for i, _ in pairs],
                                 [a for _, a in pairs], self.runner.adapter.kind_of)
                yield built
            return
        with ExitStack() as stack:  # in memory (or a group of one): entering a layer loads nothing
            loaded = {i: stack.enter_context(self.runner.layer(i)) for i in needed}
            sources = [loaded.get(i, loaded[grp[0]]) for i in grp]  # a dropped layer: the leader stands in (coefficient 0)
            yield collapse_group(sources, self.cand.alpha_dicts(g), self.runner.adapter.kind_of)

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


def save_solution_streamed(runner, tokenizer, cand: Candidate, record: dict, out, *, source: str, source_hash: str, config: dict,
                           overwrite: bool, dtype: str | None = None) -> None:
    """`export.save_solution` for a streamed runner: the checkpoint written one group at a time by
    `io.stream.write_streamed` (each group's collapsed layer built from its streamed sources, written as its own
    shard, freed). Its tensors, config, manifest fields and `weights_sha256` equal those `save_solution` writes
    from the model in memory."""
    from llmcompress.collapse.export import solution_manifest
    from llmcompress.io.stream import write_streamed
    from llmcompress.io.surgery import replace_layers, shared_copy

    skeleton = shared_copy(runner.model)  # its decoder layers stay on the meta device: only the config and names change
    old = runner.adapter.decoder_layers(skeleton)
    replace_layers(skeleton, [old[grp[0]] for grp in cand.groups], [grp[0] for grp in cand.groups])
    manifest = solution_manifest(cand, record, source=source, source_hash=source_hash, config=config)
    write_streamed(skeleton, CollapsedRunner(runner, cand), tokenizer, out, manifest, compute_dtype=runner.dtype, dtype=dtype,
                   overwrite=overwrite)


__all__ = ["CollapsedRunner", "read_sources", "run_groups", "save_solution_streamed"]
