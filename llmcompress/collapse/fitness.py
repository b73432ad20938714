"""Fitness of a collapsed candidate: KL to the original's next-token distribution and residual-update similarity.

The original model's hidden state at every layer boundary and its top-k log-probabilities are cached once
per data split (`Reference`); a candidate's forward starts at its first changed layer from the cached state
(`Evaluator`), so the prefix it shares with the original is never recomputed.

Three more savings, each exact (fp32: bit-identical fitness values; tests/test_collapse_speed.py):

* Prefix states (`PrefixStates`): a candidate's own hidden states at the entry and exit of each of its changed
  groups are kept in a byte-bounded LRU keyed by the group prefix that produced them, so a later candidate
  that shares more than the original's prefix (a mutated child, a crossover, a walk's neighbour) starts at
  the deepest boundary it shares with any candidate scored before. A GA's offspring and a walk's neighbours
  share long prefixes with their parents; nothing in pymoo or torch caches this, hence this small LRU.
* Racing (`evaluate(..., prune=)`): the top-k KL is a mean of non-negative per-position terms, so after some
  calibration batches `(sum so far + floor * positions left) / positions` is a lower bound of the final KL.
  The search passes a rule that says when a lower bound already keeps a candidate out of the survivors
  (search.py); the evaluation stops there and its partial sums are kept, so finishing it later (selection)
  gives exactly the value an uninterrupted evaluation gives.
* bf16 compute (`compute_dtype="bfloat16"`): the candidate's layers run under torch.autocast (bf16 matmuls,
  fp32 residual stream); the final norm, the head and the KL stay in fp32. Not exact (within bf16 tolerance);
  it pays where the CPU has bf16 matmuls (AVX512-BF16/AMX) or on a GPU (bench/bench_collapse.py --speed).
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


def block_influence(states) -> list[float]:
    """ShortGPT's Block Influence per layer: 1 - mean cos(h_in, h_out) over tokens (any iterable of states)."""
    from llmcompress import metrics

    return metrics.block_influence(states)


# ---------------------------------------------------------------- the original's cache


STATES_PREFIX = "collapse-states-"  # spilled boundary states: one temp dir per run, removed on close


class StateStore:
    """Boundary hidden states, (n, T, H) per boundary, kept in memory or spilled to disk.

    States computed on a GPU stay there while they fit `max_bytes`. Spilled ones are one safetensors file per
    boundary in a temporary folder on the host's disk (`spill=True`, or more than `max_bytes` in all), and
    `get` reads only the rows asked for, with a plain read that leaves nothing mapped: a spilled store adds
    one read's rows to the process's memory at a time, not every boundary (a memory map's touched pages would
    stay resident and count, as they did here before). `add` appends a boundary, so a streamed reference
    spills each state as it passes instead of holding them all first. Rows come back on `device` (the
    device the states were computed on).
    """

    def __init__(self, states=(), max_bytes: float = float("inf"), cache_dir: Path | None = None, device=None,
                 spill: bool | None = None) -> None:
        import torch

        states = list(states)
        total = sum(s.numel() * s.element_size() for s in states)
        self.device = device if device is not None else (states[0].device if states else torch.device("cpu"))
        self.on_disk = total > max_bytes if spill is None else spill
        self.folder = Path(tempfile.mkdtemp(prefix=STATES_PREFIX, dir=cache_dir)) if self.on_disk else None
        self._states: list = []  # in memory: the tensors; spilled: their files
        self.nbytes = 0
        self.rows: int | None = None  # blocks per boundary (a spilled view of the first n reads no further)
        for s in states:
            self.add(s)

    def add(self, state: torch.Tensor) -> None:
        """Append the next boundary's states (spilled: written to disk now, nothing kept in memory)."""
        from safetensors.torch import save_file

        self.nbytes += state.numel() * state.element_size()
        self.rows = state.shape[0] if self.rows is None else self.rows
        if not self.on_disk:
            self._states.append(state)
            return
        path = self.folder / f"b{len(self._states)}.safetensors"
        with atomic_path(path) as tmp:
            save_file({"s": state.detach().cpu().contiguous()}, str(tmp))
        self._states.append(path)

    def __len__(self) -> int:
        return len(self._states)

    def get(self, i: int, rows: slice) -> torch.Tensor:
        if not self.on_disk:
            return self._states[i][rows].to(self.device)
        from safetensors import safe_open

        with safe_open(str(self._states[i]), framework="pt") as f:
            return f.get_slice("s")[slice(*rows.indices(self.rows))].to(self.device)

    def __iter__(self):
        """Every boundary's states in order, one read at a time (a spilled store holds one in memory)."""
        return (self.get(i, slice(None)) for i in range(len(self)))

    def first(self, n: int) -> StateStore:
        """The first n rows of every boundary, without a copy: views in memory; spilled, a view of the same files
        that reads no row past n and counts n rows' bytes (it deletes nothing: this store closes the files)."""
        if not self.on_disk:
            return StateStore([s[:n] for s in self._states], device=self.device)
        import copy

        view = copy.copy(self)
        view.rows = min(n, self.rows or 0)
        view.nbytes = self.nbytes * view.rows // max(1, self.rows or 1)
        view.folder = None
        return view

    def all(self) -> list[torch.Tensor]:
        """Every boundary's states as tensors (a spilled store reads them all into memory)."""
        return self._states if not self.on_disk else list(self)

    def close(self) -> None:
        if self.folder is not None:
            self._states = []
            shutil.rmtree(self.folder, ignore_errors=True)


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


def build_reference_streamed(runner, blocks, *, topk: int, stride: int, max_bytes: float, label: str = "", cache_dir=None) -> Reference:
    """`build_reference` over an `io.stream.LayerRunner` (`runner.batch` blocks per forward): one pass layer by
    layer (`io.stream.boundary_walk`, each layer read once), the boundary states gathered as they pass, the
    top-k log-probabilities from the final norm and head at the scored positions only (as a candidate's KL
    computes them, so the original scores KL 0 against itself). Equal to `build_reference` on the same
    weights within float rounding (tests/test_collapse_stream.py)."""
    import torch

    from llmcompress.io.stream import boundary_walk

    # each boundary joined as it passes (never a second copy of them all); a streamed model is above the memory
    # budget, so its states go to disk as they pass too (a 70B model's would be tens of GB)
    store = StateStore(cache_dir=cache_dir, device=runner.device, spill=True) if runner.streamed else None
    states: list[torch.Tensor] = []

    def on_layer(i, inputs, outputs):
        for s in ([inputs] if i == 0 else []) + [outputs]:
            states.append(torch.cat(s)) if store is None else store.add(torch.cat(s))

    try:
        last = boundary_walk(runner, blocks, on_layer, description=f"reference {label} (streamed)".replace("  ", " "))
    except BaseException:  # an interrupt or error half-way: no spill folder left behind
        if store is not None:
            store.close()
        raise
    idx, lp = [], []
    for h in last:
        logp = torch.log_softmax(runner.logits(h[:, ::stride]).float(), dim=-1)
        v, i_ = logp.topk(min(topk, logp.shape[-1]), dim=-1)
        idx.append(i_)
        lp.append(v)
        del logp
    if store is None:
        store = StateStore(states, max_bytes, cache_dir, device=runner.device)
    return Reference(blocks, store, torch.cat(idx), torch.cat(lp), stride, label)


# ---------------------------------------------------------------- evaluator


@dataclass
class Fitness:
    kl: float
    sim: float
    fitness: float
    layers: int
    params: int
    partial: bool = False  # racing stopped it early: kl and fitness are lower bounds (never memoized as final)

    def to_dict(self) -> dict:
        return {"kl": self.kl, "sim": self.sim, "fitness": self.fitness, "layers": self.layers, "params": self.params}


@dataclass
class EvalStats:
    evaluations: int = 0  # candidates scored on the calibration split (pruned ones included)
    seconds: float = 0.0
    memo_hits: int = 0
    pruned: int = 0  # of them, stopped early by racing
    prefix_hits: int = 0  # evaluations that started from a candidate's (not the original's) prefix state
    layers_run: int = 0  # decoder layers run per block, summed (what the prefix states save)

    @property
    def per_second(self) -> float:
        return self.evaluations / self.seconds if self.seconds > 0 else float("nan")


KL_FLOOR = -1e-4  # per-position floor of the top-k KL (>= 0 in exact arithmetic; fp32 rounding stays far above this)


class PrefixStates:
    """Hidden states of candidates at group boundaries, keyed by (split, group prefix); LRU bounded in bytes.

    The state entering group g of a candidate depends only on its groups (and merge coefficients) 0..g-1, so
    every candidate with the same first g groups may start there.
    """

    def __init__(self, max_bytes: float) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._d: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: tuple):
        t = self._d.get(key)
        if t is not None:
            self._d.move_to_end(key)
        return t

    def put(self, key: tuple, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if size > self.max_bytes or key in self._d:
            return
        self._d[key] = t
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, old = self._d.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        self._d.clear()
        self.nbytes = 0


def prefix_key(split: str, cand: Candidate, g: int) -> tuple:
    """Key of the state entering group g of `cand` on `split`."""
    return (split, cand.groups[:g], cand.alphas[:g])


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
        prefix_bytes: memory for candidates' own prefix states (0: only the original's prefix is reused).
        compute_dtype: "float32" (exact) or "bfloat16" (the candidate's layers under autocast; KL in fp32).
        runner: an `io.stream.LayerRunner` whose model is `model` (streamed: a skeleton whose decoder layers
            are read from disk when they run). A candidate then runs one group at a time over every block of
            the split (collapse/stream.py: each source layer read once per evaluation) instead of one batch
            at a time through every layer; the values are those of the batch order (same batches, same sums).
            Racing has nothing to stop there (every layer has run before the first KL term), so a streamed
            evaluation is never partial.
    """

    def __init__(self, model, calib: Reference, val: Reference | None, *, w_kl=1.0, w_sim=0.1, sim_blocks=2, batch=4, use_prefix=True,
                 use_reference=True, prefix_bytes: float = 0.0, compute_dtype: str = "float32", runner=None) -> None:
        self.model = model
        self.runner = runner
        if runner is not None and runner.model is not model:
            raise ValueError("the runner must run the evaluator's model")
        self.adapter = get_adapter(model)
        self.layers = list(self.adapter.decoder_layers(model))
        self.refs = {"calib": calib, "val": val}
        self.w_kl, self.w_sim, self.sim_blocks, self.batch, self.use_prefix = w_kl, w_sim, sim_blocks, batch, use_prefix
        self.use_reference = use_reference
        if compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype {compute_dtype!r}: use float32 or bfloat16")
        self.compute_dtype = compute_dtype
        self.prefix = PrefixStates(prefix_bytes)
        self.split_batch: dict[str, int] = {}  # blocks per forward on a split, where not `batch`
        self.memo: dict[tuple, Fitness] = {}
        self.partial: dict[tuple, tuple[float, int, int]] = {}  # (split, key) -> (KL sum, positions, next row) of a pruned run
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
        return {k for split, k in self.memo if split == "calib"} | {k for split, k in self.partial if split == "calib"}

    def params_of(self, cand: Candidate) -> int:
        removed = sum(self.layer_params[i] for grp in cand.groups for i in grp[1:])
        return self.total_params - removed

    def built_layer(self, cand: Candidate, g: int):
        """The collapsed layer of group g (original layer for a group of one); small LRU cache."""
        if self.runner is not None:
            raise RuntimeError("a runner's evaluator builds a group's layer only while it runs (collapse/stream.py)")
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

    def known(self, cand: Candidate, split: str = "calib") -> Fitness | None:
        """The memoized final fitness, if any (no evaluation)."""
        return self.memo.get((split, cand.key))

    def lower_bound(self, cand: Candidate, split: str = "calib") -> float:
        """The best fitness `cand` can still have: its fitness when known, the racing bound when it was
        pruned, -inf when it was never scored."""
        key = (split, cand.key)
        if key in self.memo:
            return self.memo[key].fitness
        if key not in self.partial:
            return -math.inf
        total, count, _ = self.partial[key]
        ref = self.refs[split]
        n_pos = ref.n_blocks * int(ref.top_idx.shape[1])
        return self.w_kl * (total + KL_FLOOR * (n_pos - count)) / n_pos + self.w_sim * (1.0 - self.similarity(cand))

    def evaluate(self, cand: Candidate, split: str = "calib", prune=None) -> Fitness:
        """Fitness of `cand` on `split` (memoized).

        Args:
            prune: racing rule, callable(lower_bound_fitness) -> True when a candidate whose fitness is at
                least that can be dropped. Checked after every batch; a pruned evaluation returns a Fitness
                with `partial=True` (kl, fitness: lower bounds) and keeps its sums, so that a later call
                without `prune` finishes it with the value an uninterrupted evaluation gives.
        """
        key = (split, cand.key)
        if split == "calib":
            self.archive[cand.key] = cand  # also on a memo hit: an archive cleared between searches refills
        if key in self.memo:
            self.stats.memo_hits += 1
            return self.memo[key]
        t0 = time.perf_counter()
        sim = self.similarity(cand)
        fresh = key not in self.partial
        bound = None
        if prune is not None:
            def bound(kl_lb: float) -> bool:
                return prune(self.w_kl * kl_lb + self.w_sim * (1.0 - sim))
        kl, done = self._kl(cand, self.refs[split], key, bound)
        fit = Fitness(kl, sim, self.w_kl * kl + self.w_sim * (1.0 - sim), cand.n_layers, self.params_of(cand), partial=not done)
        if done:
            self.memo[key] = fit
            self.partial.pop(key, None)
        if split == "calib":
            if fresh:
                self.stats.evaluations += 1
            self.stats.pruned += int(not done)
            self.stats.seconds += time.perf_counter() - t0
        return fit

    def _suffix(self, cand: Candidate) -> tuple[int, list, list[int]]:
        """(boundary index to start from, layers to run, their origins), from the original's prefix."""
        g0 = cand.first_changed() if self.use_prefix else 0
        layers = [self.built_layer(cand, g) for g in range(g0, len(cand.groups))]
        origin = [grp[0] for grp in cand.groups[g0:]]
        return cand.groups[g0][0], layers, origin

    def _autocast(self, device):
        import contextlib

        import torch

        if self.compute_dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)

    def _first_group(self, cand: Candidate) -> int:
        g0 = cand.first_changed() if self.use_prefix else 0
        return 0 if g0 is None else g0

    def _start(self, cand: Candidate, split: str) -> tuple[int, torch.Tensor | None]:
        """(group to start at, its cached entry state or None for the original's boundary state)."""
        g0 = self._first_group(cand)
        if self.use_prefix and self.prefix.max_bytes > 0:
            for g in range(len(cand.groups) - 1, g0, -1):
                t = self.prefix.get(prefix_key(split, cand, g))
                if t is not None:
                    self.stats.prefix_hits += int(split == "calib")
                    return g, t
        return g0, None

    def _run_suffix(self, cand: Candidate, ref: Reference, rows: slice, g_start: int, state, keep: list[int] | None = None):
        """The last hidden state of `cand` on `rows` from group `g_start`; with `keep`, also the states
        entering those groups ({g: state})."""
        import torch

        from llmcompress.io.forward import first_output

        h0 = ref.states.get(cand.groups[g_start][0], rows) if state is None else state[rows].to(ref.states.device)
        layers = [self.built_layer(cand, g) for g in range(g_start, len(cand.groups))]
        origin = [grp[0] for grp in cand.groups[g_start:]]
        grabbed: dict[int, torch.Tensor] = {}
        hooks = []
        for g in keep or []:
            def grab(module, args, out, g=g):
                grabbed[g] = first_output(out).detach()
            hooks.append(layers[g - 1 - g_start].register_forward_hook(grab))
        try:
            with torch.no_grad(), self._autocast(h0.device):
                h = run_layers(self.model, h0, layers, origin, output="hidden")
        finally:
            for hk in hooks:
                hk.remove()
        self.stats.layers_run += len(layers) * int(h0.shape[0])
        return h, grabbed

    def _to_keep(self, cand: Candidate, g_start: int, ref: Reference) -> list[int]:
        """Groups whose entry state is worth keeping: every boundary after g_start when they take at most 1/8 of
        the budget (a walk's few screening blocks: its neighbours then start where they leave the incumbent),
        else the entry and the exit of every changed group (where a GA's children mostly leave their parents)."""
        if not self.use_prefix or self.prefix.max_bytes <= 0:
            return []
        every = list(range(g_start + 1, len(cand.groups)))
        per_state = ref.states.nbytes / max(1, len(ref.states))
        if len(every) * per_state <= self.prefix.max_bytes / 8:
            return every
        return [g for g in every if len(cand.groups[g]) > 1 or len(cand.groups[g - 1]) > 1]

    def final_hidden(self, cand: Candidate, ref: Reference, rows: slice):
        """The candidate's last hidden state (before the final norm) on `rows` of `ref`, from the original's prefix."""
        if self.runner is not None:
            g0 = self._first_group(cand)
            h = self._run_groups(cand, g0, [ref.states.get(cand.groups[g0][0], rows)])[0][0]
            self.stats.layers_run += (len(cand.groups) - g0) * int(h.shape[0])
            return h
        return self._run_suffix(cand, ref, rows, self._first_group(cand), None)[0]

    def _run_groups(self, cand: Candidate, g_start: int, hidden: list, keep=(), autocast: bool = True):
        """Streamed (`runner`): per-batch states entering group `g_start` through the candidate's remaining
        groups, one group at a time (collapse/stream.py); with `keep`, the states entering those groups too."""
        from llmcompress.collapse.stream import CollapsedRunner, run_groups

        ctx = (lambda: self._autocast(self.runner.device)) if autocast else None
        return run_groups(CollapsedRunner(self.runner, cand), g_start, hidden, keep, ctx)

    def kl(self, cand: Candidate, ref: Reference) -> float:
        """Mean top-k KL(original || candidate) over the scored positions of `ref` (not memoized)."""
        return self._kl(cand, ref, None, None)[0]

    def _kl(self, cand: Candidate, ref: Reference, key, bound) -> tuple[float, bool]:
        """(mean KL or, when `bound` stopped it, a lower bound of it; finished)."""
        import torch

        if cand.first_changed() is None and self.use_prefix and self.use_reference:
            return 0.0, True
        total, count, row0 = self.partial.get(key, (0.0, 0, 0)) if key is not None else (0.0, 0, 0)
        n_pos = ref.n_blocks * int(ref.top_idx.shape[1])
        split = key[0] if key is not None else None
        g_start, state = self._start(cand, split) if split is not None else (self._first_group(cand), None)
        keep = self._to_keep(cand, g_start, ref) if split is not None and row0 == 0 else []
        kept: dict[int, list] = {g: [] for g in keep}
        if bound is not None and row0 > 0 and bound((total + KL_FLOOR * (n_pos - count)) / n_pos):
            return (total + KL_FLOOR * (n_pos - count)) / n_pos, False  # pruned before, and still
        batch = self.split_batch.get(split, self.batch)
        if self.runner is not None:
            return self._kl_streamed(cand, ref, split, g_start, state, keep, batch), True
        with torch.no_grad():
            for s in range(row0, ref.n_blocks, batch):
                rows = slice(s, s + batch)
                h, grabbed = self._run_suffix(cand, ref, rows, g_start, state, keep)
                for g, t in grabbed.items():
                    kept[g].append(t)
                h = h[:, :: ref.stride]
                top_idx, top_logp = ref.top_idx[rows], ref.top_logp[rows]
                if not self.use_reference:  # naive baseline: rerun the original on the tokens
                    logits = self.model(input_ids=ref.blocks[rows].to(h.device), use_cache=False).logits[:, :: ref.stride]
                    top_logp, top_idx = torch.log_softmax(logits.float(), dim=-1).topk(top_idx.shape[-1], dim=-1)
                kl = self.scored_kl(h.float(), top_idx, top_logp)
                total += float(kl.sum())
                count += kl.numel()
                nxt = s + batch
                if bound is not None and nxt < ref.n_blocks and bound((total + KL_FLOOR * (n_pos - count)) / n_pos):
                    self.partial[key] = (total, count, nxt)
                    return (total + KL_FLOOR * (n_pos - count)) / n_pos, False
        for g, parts in kept.items():
            self.prefix.put(prefix_key(split, cand, g), torch.cat(parts))
        return total / count, True

    def _kl_streamed(self, cand: Candidate, ref: Reference, split, g_start: int, state, keep: list[int], batch: int) -> float:
        """`_kl` for a runner: the same batches and the same sums, the groups run over all of them in turn."""
        import torch

        if not self.use_reference:
            raise ValueError("a runner's evaluator scores against the cached reference (use_reference=True)")
        starts = range(0, ref.n_blocks, batch)
        if state is None:
            hidden = [ref.states.get(cand.groups[g_start][0], slice(s, s + batch)) for s in starts]
        else:
            hidden = [state[s : s + batch].to(ref.states.device) for s in starts]
        with torch.no_grad():
            hidden, kept = self._run_groups(cand, g_start, hidden, keep)
            self.stats.layers_run += (len(cand.groups) - g_start) * ref.n_blocks
            total, count = 0.0, 0
            for s, h in zip(starts, hidden):
                kl = self.scored_kl(h[:, :: ref.stride].float(), ref.top_idx[s : s + batch], ref.top_logp[s : s + batch])
                total += float(kl.sum())
                count += kl.numel()
        for g, parts in kept.items():
            self.prefix.put(prefix_key(split, cand, g), torch.cat([t.detach() for t in parts]))
        return total / count

    def scored_kl(self, h: torch.Tensor, top_idx: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
        """Per-position top-k KL of a candidate's last hidden state `h` (before the final norm, at the scored
        positions) against the original's top-k log-probabilities; differentiable in `h` (tune.py)."""
        import torch

        if self.runner is not None:  # its head may be kept narrower than the compute dtype (io/stream.py)
            return topk_kl(torch.log_softmax(self.runner.logits(h).float(), dim=-1), top_idx, top_logp)
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
                if self.runner is not None:
                    from llmcompress.collapse.stream import CollapsedRunner

                    cr = CollapsedRunner(self.runner, cand)
                    with cr.layer(g) as layer:
                        h_new = cr.run(g, layer, h_in)
                else:
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
        cols = slice(0, max_tokens)
        if self.runner is not None:
            g0 = cand.first_changed() if self.use_prefix else 0
            with torch.no_grad():
                h = self._run_groups(cand, g0, [ref.states.get(cand.groups[g0][0], rows)[:, cols]], autocast=False)[0][0]
            return float(F.cosine_similarity(h.float(), ref.states.get(self.n_layers, rows)[:, cols].float(), dim=-1).mean())
        start, layers, origin = self._suffix(cand)
        with torch.no_grad():
            h = run_layers(self.model, ref.states.get(start, rows)[:, cols], layers, origin, output="hidden")
        return float(F.cosine_similarity(h.float(), ref.states.get(self.n_layers, rows)[:, cols].float(), dim=-1).mean())

    def close(self) -> None:
        for ref in self.refs.values():
            if ref is not None:
                ref.states.close()


def fitness_is_finite(f: Fitness) -> bool:
    return math.isfinite(f.kl) and math.isfinite(f.fitness)


def prepare(cfg, lm, *, calib_blocks=None, val_blocks=None, cache_dir=None, runner=None):
    """The Evaluator of a collapse run (a `CollapseConfig`) on a loaded model: calibration/validation blocks
    (read unless given) and their cached references. With `runner` (an `io.stream.LayerRunner` over
    `lm.model`, streamed for a model larger than memory), the references are built layer by layer and the
    candidates run group by group (`build_reference_streamed`, `Evaluator(runner=)`); `self` data, which is
    sampled from the whole model, is then unavailable (one-line error)."""
    from llmcompress.collapse.config import resolve_fitness_dtype
    from llmcompress.data import calibration_blocks

    n_cal, n_val = cfg.calib_tokens // cfg.seq_len, cfg.val_tokens // cfg.seq_len
    labels = {}
    sampler = None if runner is not None and runner.streamed else lm.model
    if calib_blocks is None:
        calib_blocks, labels["calib"] = calibration_blocks(
            lm.tokenizer, cfg.calib_source, split=cfg.calib_split, seq_len=cfg.seq_len, n_blocks=n_cal, seed=cfg.seed, model=sampler
        )
    if val_blocks is None:
        val_blocks, labels["val"] = calibration_blocks(
            lm.tokenizer, cfg.calib_source, split=cfg.calib_split, seq_len=cfg.seq_len, n_blocks=n_val, seed=cfg.seed,
            offset=cfg.val_offset, model=sampler,
        )
    max_bytes = cfg.max_cache_gb * 2**30 / 2  # half the budget each for calibration and validation
    common = dict(topk=cfg.kl_topk, stride=cfg.kl_stride, max_bytes=max_bytes, cache_dir=cache_dir)
    if runner is not None:
        runner.batch = cfg.batch_blocks
        calib = build_reference_streamed(runner, calib_blocks, label=labels.get("calib", "given"), **common)
        val = build_reference_streamed(runner, val_blocks, label=labels.get("val", "given"), **common)
        device = runner.device
    else:
        calib = build_reference(lm.model, calib_blocks, label=labels.get("calib", "given"), batch=cfg.batch_blocks, **common)
        val = build_reference(lm.model, val_blocks, label=labels.get("val", "given"), batch=cfg.batch_blocks, **common)
        device = next(lm.model.parameters()).device
    ev = Evaluator(lm.model, calib, val, w_kl=cfg.w_kl, w_sim=cfg.w_sim, sim_blocks=cfg.sim_blocks, batch=cfg.batch_blocks,
                   prefix_bytes=cfg.prefix_cache_gb * 2**30, runner=runner,
                   compute_dtype=resolve_fitness_dtype(cfg.fitness_dtype, device.type))
    return ev


__all__ = ["Evaluator", "Fitness", "Reference", "build_reference", "build_reference_streamed", "topk_kl", "update_cosine", "block_influence", "prepare"]
