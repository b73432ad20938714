"""Fitness of a collapsed candidate: KL to the original's next-token distribution and residual-update similarity.

The original model's hidden state at every layer boundary and its top-k log-probabilities are cached once
per data split (`Reference`); a candidate's forward starts at its first changed layer from the cached state
(`Evaluator`), so the prefix it shares with the original is never recomputed.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmcompress.collapse.operator import collapse_group
from llmcompress.collapse.space import Candidate
from llmcompress.io.adapters import get_adapter
from llmcompress.io.atomic import atomic_path
from llmcompress.io.forward import boundary_states, run_layers

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------- pure tensor functions


def topk_kl(logp_q: torch.Tensor, top_idx: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per position, with P known on its top-k tokens plus one bucket for the rest.

    Args:
        logp_q: (..., V) candidate log-probabilities.
        top_idx: (..., k) the original's top-k token ids; top_logp: (..., k) their log-probabilities.
    Returns:
        (...) KL in nats; exact when the top-k holds all of P's mass.
    """
    from llmcompress import metrics

    return metrics.topk_kl(logp_q, top_idx, top_logp)


def update_cosine(h_in: torch.Tensor, h_ref: torch.Tensor, h_new: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity between residual updates h_ref - h_in and h_new - h_in over all tokens."""
    import torch.nn.functional as F

    return F.cosine_similarity((h_ref - h_in).float(), (h_new - h_in).float(), dim=-1).mean()


def block_influence(states: list[torch.Tensor]) -> list[float]:
    """ShortGPT's Block Influence per layer: 1 - mean cos(h_in, h_out) over tokens."""
    from llmcompress import metrics

    return metrics.block_influence(states)


# ---------------------------------------------------------------- the original's cache


STATES_PREFIX = "collapse-states-"  # spilled boundary states: one temp dir per run, removed on close


class StateStore:
    """Boundary hidden states, (n, T, H) per boundary, kept in memory or memory-mapped from disk.

    States computed on a GPU stay there while they fit `max_bytes`; spilled ones live on the host's disk
    and `get` brings the rows asked for back to `device` (the device the states were computed on).
    """

    def __init__(self, states: list[torch.Tensor], max_bytes: float, cache_dir: Path | None = None, device=None) -> None:
        import torch

        total = sum(s.numel() * s.element_size() for s in states)
        self.device = device if device is not None else (states[0].device if states else torch.device("cpu"))
        self.on_disk = total > max_bytes
        self._dir = None
        if self.on_disk:
            self._dir = Path(tempfile.mkdtemp(prefix=STATES_PREFIX, dir=cache_dir))
            self._states = []
            for i, s in enumerate(states):
                path = self._dir / f"b{i}.pt"
                with atomic_path(path) as tmp:
                    torch.save(s.cpu().contiguous(), tmp)
                self._states.append(torch.load(path, mmap=True, weights_only=True))
        else:
            self._states = states
        self.nbytes = total

    def __len__(self) -> int:
        return len(self._states)

    def get(self, i: int, rows: slice) -> torch.Tensor:
        return self._states[i][rows].to(self.device)

    def all(self) -> list[torch.Tensor]:
        return self._states

    def close(self) -> None:
        if self._dir is not None:
            self._states = []
            shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class Reference:
    """The original model on one data split: boundary states, top-k log-probabilities at scored positions."""

    blocks: torch.Tensor  # (n, T) token ids
    states: StateStore  # L+1 boundaries, each (n, T, H)
    top_idx: torch.Tensor  # (n, T', k) with T' = ceil(T / stride)
    top_logp: torch.Tensor  # (n, T', k)
    stride: int
    label: str = ""

    @property
    def n_blocks(self) -> int:
        return int(self.blocks.shape[0])


def build_reference(model, blocks, *, topk: int, stride: int, batch: int, max_bytes: float, label: str = "", cache_dir=None) -> Reference:
    """Run the original once over `blocks`, caching boundary states and top-k log-probabilities."""
    import torch

    per_boundary: list[list[torch.Tensor]] = []
    idx, lp = [], []
    device = next(model.parameters()).device
    for s in range(0, blocks.shape[0], batch):
        states, logits = boundary_states(model, blocks[s : s + batch].to(device))
        if not per_boundary:
            per_boundary = [[] for _ in states]
        for i, st in enumerate(states):
            per_boundary[i].append(st.detach())
        logp = torch.log_softmax(logits[:, ::stride].float(), dim=-1)
        v, i_ = logp.topk(min(topk, logp.shape[-1]), dim=-1)
        idx.append(i_)
        lp.append(v)
        del logits, logp
    states = [torch.cat(p) for p in per_boundary]
    store = StateStore(states, max_bytes, cache_dir)
    return Reference(blocks, store, torch.cat(idx), torch.cat(lp), stride, label)


# ---------------------------------------------------------------- evaluator


@dataclass
class Fitness:
    kl: float
    sim: float
    fitness: float
    layers: int
    params: int

    def to_dict(self) -> dict:
        return {"kl": self.kl, "sim": self.sim, "fitness": self.fitness, "layers": self.layers, "params": self.params}


@dataclass
class EvalStats:
    evaluations: int = 0
    seconds: float = 0.0
    memo_hits: int = 0

    @property
    def per_second(self) -> float:
        return self.evaluations / self.seconds if self.seconds > 0 else float("nan")


class Evaluator:
    """Scores candidates against cached references. Memoized by candidate; deterministic.

    Args:
        model: the original model (never modified; candidates run through swapped layers).
        calib / val: references of the calibration and validation splits (validation is never optimized on).
        w_kl, w_sim: fitness = w_kl * KL + w_sim * (1 - similarity).
        sim_blocks: calibration blocks on which the residual-update similarity is measured.
        batch: blocks per forward.
        use_prefix: start each candidate at its first changed layer (False: full forward, for benchmarks).
        use_reference: score the KL against the cached top-k log-probabilities of the original (False:
            recompute the original's forward for every evaluation, as a notebook does; benchmarks only).
    """

    def __init__(self, model, calib: Reference, val: Reference | None, *, w_kl=1.0, w_sim=0.1, sim_blocks=2, batch=4, use_prefix=True, use_reference=True) -> None:
        self.model = model
        self.adapter = get_adapter(model)
        self.layers = list(self.adapter.decoder_layers(model))
        self.refs = {"calib": calib, "val": val}
        self.w_kl, self.w_sim, self.sim_blocks, self.batch, self.use_prefix = w_kl, w_sim, sim_blocks, batch, use_prefix
        self.use_reference = use_reference
        self.memo: dict[tuple, Fitness] = {}
        self.archive: dict[tuple, Candidate] = {}
        self._sim_memo: dict[tuple, float] = {}
        self._built: OrderedDict[tuple, object] = OrderedDict()
        self.stats = EvalStats()
        self.total_params = sum(p.numel() for p in model.parameters())
        self.layer_params = [sum(p.numel() for p in layer.parameters()) for layer in self.layers]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def calib_keys(self) -> set[tuple]:
        """Keys of the candidates scored on calibration data so far (what `stats.evaluations` counts)."""
        return {k for split, k in self.memo if split == "calib"}

    def params_of(self, cand: Candidate) -> int:
        removed = sum(self.layer_params[i] for grp in cand.groups for i in grp[1:])
        return self.total_params - removed

    def built_layer(self, cand: Candidate, g: int):
        """The collapsed layer of group g (original layer for a group of one); small LRU cache."""
        grp = cand.groups[g]
        if len(grp) == 1:
            return self.layers[grp[0]]
        key = (grp, cand.alphas[g])
        if key not in self._built:
            self._built[key] = collapse_group([self.layers[i] for i in grp], cand.alpha_dicts(g), self.adapter.kind_of)
            if len(self._built) > 64:
                self._built.popitem(last=False)
        self._built.move_to_end(key)
        return self._built[key]

    def evaluate(self, cand: Candidate, split: str = "calib") -> Fitness:
        key = (split, cand.key)
        if split == "calib":
            self.archive[cand.key] = cand  # also on a memo hit: an archive cleared between searches refills
        if key in self.memo:
            self.stats.memo_hits += 1
            return self.memo[key]
        t0 = time.perf_counter()
        kl = self.kl(cand, self.refs[split])
        sim = self.similarity(cand)
        fit = Fitness(kl, sim, self.w_kl * kl + self.w_sim * (1.0 - sim), cand.n_layers, self.params_of(cand))
        self.memo[key] = fit
        if split == "calib":
            self.stats.evaluations += 1
            self.stats.seconds += time.perf_counter() - t0
        return fit

    def _suffix(self, cand: Candidate) -> tuple[int, list, list[int]]:
        """(boundary index to start from, layers to run, their origins)."""
        g0 = cand.first_changed() if self.use_prefix else 0
        layers = [self.built_layer(cand, g) for g in range(g0, len(cand.groups))]
        origin = [grp[0] for grp in cand.groups[g0:]]
        return cand.groups[g0][0], layers, origin

    def final_hidden(self, cand: Candidate, ref: Reference, rows: slice):
        import torch

        start, layers, origin = self._suffix(cand)
        with torch.no_grad():
            return run_layers(self.model, ref.states.get(start, rows), layers, origin, output="hidden")

    def kl(self, cand: Candidate, ref: Reference) -> float:
        """Mean top-k KL(original || candidate) over the scored positions of `ref`."""
        import torch

        if cand.first_changed() is None and self.use_prefix and self.use_reference:
            return 0.0
        total, count = 0.0, 0
        with torch.no_grad():
            for s in range(0, ref.n_blocks, self.batch):
                rows = slice(s, s + self.batch)
                h = self.final_hidden(cand, ref, rows)[:, :: ref.stride]
                top_idx, top_logp = ref.top_idx[rows], ref.top_logp[rows]
                if not self.use_reference:  # naive baseline: rerun the original on the tokens
                    logits = self.model(input_ids=ref.blocks[rows].to(h.device), use_cache=False).logits[:, :: ref.stride]
                    top_logp, top_idx = torch.log_softmax(logits.float(), dim=-1).topk(top_idx.shape[-1], dim=-1)
                kl = self.scored_kl(h, top_idx, top_logp)
                total += float(kl.sum())
                count += kl.numel()
        return total / count

    def scored_kl(self, h: torch.Tensor, top_idx: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
        """Per-position top-k KL of a candidate's last hidden state `h` (before the final norm, at the scored
        positions) against the original's top-k log-probabilities; differentiable in `h` (tune.py)."""
        import torch

        logits = self.adapter.head(self.model)(self.adapter.norm(self.model)(h))
        return topk_kl(torch.log_softmax(logits.float(), dim=-1), top_idx, top_logp)

    def similarity(self, cand: Candidate) -> float:
        """Mean residual-update cosine of the changed groups, weighted by the layers each group removes."""
        num, den = 0.0, 0
        for g, grp in enumerate(cand.groups):
            if len(grp) > 1:
                num += self.group_similarity(cand, g) * (len(grp) - 1)
                den += len(grp) - 1
        return num / den if den else 1.0

    def group_similarity(self, cand: Candidate, g: int) -> float:
        import torch

        grp = cand.groups[g]
        key = (grp, cand.alphas[g])
        if key not in self._sim_memo:
            ref = self.refs["calib"]
            rows = slice(0, self.sim_blocks)
            h_in, h_ref = ref.states.get(grp[0], rows), ref.states.get(grp[-1] + 1, rows)
            with torch.no_grad():
                h_new = run_layers(self.model, h_in, [self.built_layer(cand, g)], [grp[0]], output="hidden")
            self._sim_memo[key] = float(update_cosine(h_in, h_ref, h_new))
        return self._sim_memo[key]

    def final_similarity(self, cand: Candidate, n_blocks: int, max_tokens: int | None = None) -> float:
        """Cosine between the original's and the candidate's last hidden states (LaCo's acceptance test)."""
        import torch
        import torch.nn.functional as F

        ref = self.refs["calib"]
        rows = slice(0, n_blocks)
        if cand.first_changed() is None:
            return 1.0
        start, layers, origin = self._suffix(cand)
        cols = slice(0, max_tokens)
        with torch.no_grad():
            h = run_layers(self.model, ref.states.get(start, rows)[:, cols], layers, origin, output="hidden")
        return float(F.cosine_similarity(h.float(), ref.states.get(self.n_layers, rows)[:, cols].float(), dim=-1).mean())

    def close(self) -> None:
        for ref in self.refs.values():
            if ref is not None:
                ref.states.close()


def fitness_is_finite(f: Fitness) -> bool:
    return math.isfinite(f.kl) and math.isfinite(f.fitness)


__all__ = ["Evaluator", "Fitness", "Reference", "build_reference", "topk_kl", "update_cosine", "block_influence"]
