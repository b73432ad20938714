"""Gradient compression for DDP: plain, lossless ZipCCL, PowerSGD and EDGC, with exact byte accounting.

EDGC (entropy-driven dynamic gradient compression, arXiv 2511.10333) adapts PowerSGD's rank to the
information in the gradients. It is built on torch's own `powerSGD_hook` (error feedback, warm start,
`min_compression_rate`, batching of same-shape tensors): `EDGCState` subclasses `PowerSGDState` and only
changes `matrix_approximation_rank` between windows. What torch lacks and is written here:

* **Entropy sampling** (`entropy_bits`): every `sample_every`-th step, each weight matrix's *reduced*
  gradient (the hook's result, identical on every rank) is subsampled with a stride (a `sample_fraction`
  of the elements), put into a 1000-bin histogram over its [min, max] and its Shannon entropy taken in bits
  (the reference code's estimator). Matrices are averaged weighted by their element count (per matrix, not
  per bucket, so the figure does not depend on how DDP buckets the gradients).
* **Quantification model** (`target_rank`): the reference H_ref is the *peak* of the windowed mean entropy
  so far (every window's mean, all-reduced; the warm-up's dense gradients are not windows: their entropy is
  of a different, uncompressed signal). A window's mean entropy H maps linearly onto the rank range:
  r = r_min + (r_max - r_min) * clip(1 - (H_ref - H) / span, 0, 1) with span = `entropy_span` x H_ref
  (default 0.1); i.e. as the gradients' information (entropy) falls by `entropy_span` of its peak, the rank
  goes from r_max down to r_min; if it climbs back, the rank goes back up, and a new peak gives r_max.
  A first-window reference misses a drop that follows a climb above the first window (the rank stays at
  r_max until the entropy falls below the first window's); the peak measures every drop from the most
  information seen so far.
* **Window adjustment** (`next_rank`): at the end of each `window` of steps the rank moves towards the
  target by at most `max_step` (±4 as in the reference). The window's entropy sums are all-reduced
  first, so every rank computes the same number from the same bits and picks the same rank (a mismatch
  would hang PowerSGD's all-reduce of P and Q).
* **Warm-up**: torch's `start_powerSGD_iter` semantics: steps 0 .. start_iter - 1 are plain all-reduces
  (the same bits as `none`), compression starts at step start_iter; fixed-rank PowerSGD and EDGC use the
  same default (2, the least DDP allows: it rebuilds its buckets after iteration 1).
* **Rank change** (`set_rank`): P/Q buffers are cleared (their size depends on the rank; torch would slice
  the old buffer into wrongly sized views), the error-feedback buffers are kept (the reference code loses
  them by rebuilding its reducer). A cleared Q means one cold step: torch re-draws Q at random, so that
  step's approximation is one power iteration from noise instead of from last step's factors. `carry_q`
  keeps the warm start instead: each matrix's Q is resized, its leading min(old, new) columns kept (new
  columns random; torch orthogonalises Q before use either way).
* **Layout-independent state**: error feedback and P/Q are kept per bucket index by torch; DDP rebuilds its
  buckets after the first iteration of every new DDP object, so after `--resume` the saved buckets do not
  match. `state_dict()` stores them per parameter and the hook reassembles them for whatever layout a
  bucket has (`_sync_layout`), so a resumed run continues exactly where it stopped.
* **Accounting**: the bytes each rank sends, per step, for every scheme (warm-up steps included, which
  `compression_stats()` does not count). Collectives built on `dist.all_reduce` are counted as a ring
  all-reduce moves them: 2 (w - 1) / w x payload bytes per rank; ZipCCL counts the bytes it actually sends
  peer to peer (sizes and encoded payloads).

`end_step()` must be called once per optimiser step after backward (the training loop does): it closes the
step's byte count and, for EDGC, the window.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

SCHEMES = ("none", "zip", "powersgd", "edgc")
BINS = 1000
ENTROPY_SPAN = 0.1  # the entropy drop, as a share of its peak, that takes the rank from r_max to r_min
WARMUP = 2  # dense all-reduce steps before PowerSGD/EDGC compress (torch's start_powerSGD_iter)


# ------------------------------------------------------------------------------------ pure math


def entropy_bits(t: torch.Tensor, fraction: float = 0.01, bins: int = BINS) -> float:
    """Shannon entropy (bits) of a `bins`-bin histogram of a strided `fraction` of `t`'s elements."""
    flat = t.detach().reshape(-1)
    stride = max(1, int(round(1.0 / max(fraction, 1e-9))))
    x = flat[::stride].float()
    x = x[torch.isfinite(x)]
    if x.numel() < 2:
        return 0.0
    lo, hi = float(x.min()), float(x.max())
    if hi <= lo:
        return 0.0
    h = torch.histc(x, bins=bins, min=lo, max=hi)
    p = h[h > 0] / x.numel()
    return float(-(p * p.log2()).sum())


def target_rank(h: float, h_ref: float, span: float, r_min: int, r_max: int) -> int:
    """The quantification model: entropy H -> rank (linear; H_ref -> r_max, H_ref - span x H_ref -> r_min)."""
    drop = (h_ref - h) / max(span * h_ref, 1e-12)
    frac = min(1.0, max(0.0, 1.0 - drop))
    return int(round(r_min + (r_max - r_min) * frac))


def next_rank(rank: int, target: int, max_step: int) -> int:
    """Move from `rank` towards `target` by at most `max_step`."""
    return rank + max(-max_step, min(max_step, target - rank))


def ring_factor(world: int) -> float:
    """Bytes a ring all-reduce sends per rank, per payload byte."""
    return 2.0 * (world - 1) / world if world > 1 else 0.0


def powersgd_payload(shapes: list[tuple[int, ...]], rank: int, elem: int, min_rate: float) -> tuple[int, int]:
    """(bytes all-reduced, of which P and Q) for one bucket under torch's per-tensor PowerSGD rule."""
    total = pq = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, rank)
        if (n + m) * r * min_rate < n * m:
            total += (n + m) * r * elem
            pq += (n + m) * r * elem
        else:
            total += n * m * elem
    return total, pq


# ------------------------------------------------------------------------------------ state


class EDGCState(psgd.PowerSGDState):
    """PowerSGDState plus EDGC's entropy monitor and rank schedule, resumable across bucket layouts.

    With `adapt=False` it is plain PowerSGD at the fixed rank `rank` (same accounting and resumable state).
    """

    __slots__ = [
        "adapt", "r_min", "r_max", "window", "sample_every", "sample_fraction", "entropy_span", "max_step",
        "names", "shapes", "layout", "pool", "h_ref", "win", "step_h", "rank_trace", "entropy_trace",
        "monitor_s", "forced", "changes", "carry_q",
    ]

    def __init__(self, process_group=None, *, rank: int = 8, r_min: int = 2, r_max: int = 32, adapt: bool = True,
                 start_iter: int = 2, window: int = 10, sample_every: int = 2, sample_fraction: float = 0.01,
                 entropy_span: float = ENTROPY_SPAN, max_step: int = 4, min_compression_rate: float = 2.0, seed: int = 0,
                 carry_q: bool = False, names: dict | None = None):
        if start_iter < 2:
            raise ValueError("start_iter must be >= 2 (DDP rebuilds its buckets after iteration 1)")
        if adapt and not 1 <= r_min <= r_max:
            raise ValueError(f"need 1 <= r_min <= r_max (got {r_min}, {r_max})")
        super().__init__(process_group, matrix_approximation_rank=(r_max if adapt else rank), start_powerSGD_iter=start_iter,
                         min_compression_rate=min_compression_rate, use_error_feedback=True, warm_start=True,
                         orthogonalization_epsilon=1e-8, random_seed=seed, compression_stats_logging_frequency=10**9)
        self.adapt, self.r_min, self.r_max = adapt, r_min, r_max
        self.window, self.sample_every, self.sample_fraction = window, sample_every, sample_fraction
        self.entropy_span, self.max_step, self.carry_q = entropy_span, max_step, carry_q
        self.names = names or {}  # id(param) -> name
        self.shapes: dict[str, tuple] = {}
        self.layout: dict[int, list[str]] = {}  # bucket index -> parameter names, in the bucket's order
        self.pool: dict[str, dict] = {}  # name -> {"e": error, "p": P, "q": Q, "rank": r}, awaiting its bucket
        self.h_ref: float | None = None  # the peak windowed mean entropy so far
        self.win = [0.0, 0.0]  # sum of sampled step entropies, number of samples (this window)
        self.step_h = [0.0, 0.0]  # entropy x elements, elements (this step's buckets)
        self.rank_trace: list[int | None] = []
        self.entropy_trace: list[float | None] = []
        self.monitor_s = 0.0
        self.forced: int | None = None
        self.changes: list[dict] = []

    @property
    def rank(self) -> int:
        return int(self.matrix_approximation_rank)

    @property
    def compressing(self) -> bool:
        return self.iter >= self.start_powerSGD_iter

    def set_rank(self, r: int) -> None:
        """Change the rank: the rank-sized P/Q buffers are dropped (re-drawn at the next step), error feedback is
        kept. With `carry_q`, each matrix's warm-start Q keeps its leading min(old, new) columns instead (new
        columns random), in buffers of the new size."""
        if int(r) == self.rank:
            return
        carried = self._carry_q(int(r)) if self.carry_q else {}
        self.matrix_approximation_rank = int(r)
        self.p_memory_dict.clear()
        self.q_memory_dict.clear()
        for idx, (p, q) in carried.items():
            self.p_memory_dict[idx], self.q_memory_dict[idx] = p, q
        for v in self.pool.values():
            for k in ("p", "q", "rank"):
                v.pop(k, None)

    def _carry_q(self, new: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """bucket index -> (P, Q) buffers sized for rank `new`, Q's columns carried over from the current rank.

        The new columns are drawn from the state's RNG, which every replica advances alike (as torch's own draw)."""
        out = {}
        for idx, names in self.layout.items():
            p, q = self.p_memory_dict.get(idx), self.q_memory_dict.get(idx)
            old_s, new_s = self.pq_slices(names), self.pq_slices(names, new)
            if p is None or q is None or not new_s:
                continue
            gen = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
            q_new = torch.empty(sum(s[3] for s in new_s.values()), dtype=q.dtype)
            for name, (_, _, qo, qn) in new_s.items():
                shape = self.shapes[name]
                n, m = shape[0], math.prod(shape[1:])
                block = torch.randn(m, min(n, m, new), generator=gen, dtype=q.dtype)
                if name in old_s:
                    _, _, oqo, oqn = old_s[name]
                    prev = q[oqo : oqo + oqn].detach().cpu().view(m, oqn // m)
                    k = min(prev.shape[1], block.shape[1])
                    block[:, :k] = prev[:, :k]
                q_new[qo : qo + qn] = block.reshape(-1)
            out[idx] = (torch.zeros(sum(s[1] for s in new_s.values()), dtype=p.dtype, device=p.device), q_new.to(q.device))
        return out

    def force_rank(self, r: int) -> None:
        """Switch to rank `r` at the next `end_step` (tests, experiments); every rank must call it."""
        self.forced = int(r)

    # ---- per-parameter view of torch's per-bucket state (resume, bucket rebuilds)

    def pq_slices(self, names: list[str], rank: int | None = None) -> dict[str, tuple[int, int, int, int]]:
        """name -> (P offset, P length, Q offset, Q length) in torch's layout (compressed tensors grouped by shape)
        at `rank` (default: the current one)."""
        rank = self.rank if rank is None else rank
        groups: dict[tuple, list[str]] = defaultdict(list)
        for name in names:
            shape = self.shapes[name]
            n, m = shape[0], math.prod(shape[1:])
            if len(shape) > 1 and psgd._should_compress(n, m, min(n, m, rank), self.min_compression_rate)[0]:
                groups[(n, m)].append(name)
        out, po, qo = {}, 0, 0
        for (n, m), members in groups.items():
            r = min(n, m, rank)
            for name in members:
                out[name] = (po, n * r, qo, m * r)
                po, qo = po + n * r, qo + m * r
        return out

    def _split(self, idx: int, pool: dict, *, keep: bool) -> None:
        """Bucket `idx`'s error and P/Q into `pool`, per parameter (cloned; removed from the dicts unless `keep`)."""
        names = self.layout[idx]
        get = dict.get if keep else dict.pop
        err = get(self.error_dict, idx, None)
        p, q = get(self.p_memory_dict, idx, None), get(self.q_memory_dict, idx, None)
        off = 0
        for name in names:
            n = math.prod(self.shapes[name])
            if err is not None:
                pool.setdefault(name, {})["e"] = err[off : off + n].detach().cpu().clone()
            off += n
        if p is not None and q is not None:
            for name, (po, pn, qo, qn) in self.pq_slices(names).items():
                d = pool.setdefault(name, {})
                d["p"], d["q"], d["rank"] = p[po : po + pn].cpu().clone(), q[qo : qo + qn].cpu().clone(), self.rank

    def _assemble(self, idx: int, buf: torch.Tensor) -> None:
        names = self.layout[idx]
        if all("e" in self.pool.get(n, {}) for n in names):
            self.error_dict[idx] = torch.cat([self.pool[n].pop("e").reshape(-1) for n in names]).to(buf.device, buf.dtype)
        slices = self.pq_slices(names)
        if slices and all(self.pool.get(n, {}).get("rank") == self.rank and "p" in self.pool[n] for n in slices):
            p = torch.empty(sum(s[1] for s in slices.values()), dtype=buf.dtype)
            q = torch.empty(sum(s[3] for s in slices.values()), dtype=buf.dtype)
            for n, (po, pn, qo, qn) in slices.items():
                p[po : po + pn] = self.pool[n].pop("p")
                q[qo : qo + qn] = self.pool[n].pop("q")
                self.pool[n].pop("rank")
            self.p_memory_dict[idx], self.q_memory_dict[idx] = p.to(buf.device), q.to(buf.device)
        for n in names:
            if n in self.pool and not self.pool[n]:
                del self.pool[n]

    def sync_layout(self, bucket) -> None:
        """Make error/P/Q of this bucket index match its current parameters (after a rebuild or a resume)."""
        idx = bucket.index()
        params = bucket.parameters()
        names = [self.names.get(id(p), f"param{id(p)}") for p in params]
        if self.layout.get(idx) == names:
            return
        for p, n in zip(params, names):
            self.shapes[n] = tuple(p.shape)
        stale = [i for i, ns in self.layout.items() if i == idx or set(ns) & set(names)]
        for i in stale:  # buckets whose parameters moved: their state goes to the per-parameter pool
            self._split(i, self.pool, keep=False)
            del self.layout[i]
        self.layout[idx] = names
        if self.pool:
            self._assemble(idx, bucket.buffer())

    # ---- checkpointing (torch.load(weights_only=True) safe: tensors, numbers, strings, lists, dicts)

    def state_dict(self) -> dict[str, Any]:
        pool = {n: dict(v) for n, v in self.pool.items()}
        for idx in self.layout:
            self._split(idx, pool, keep=True)
        name, keys, pos, has_gauss, cached = self.rng.get_state()
        return {
            "iter": self.iter, "rank": self.rank, "h_ref": self.h_ref, "win": list(self.win),
            "rank_trace": list(self.rank_trace), "entropy_trace": list(self.entropy_trace), "changes": list(self.changes),
            "rng": [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)],
            "shapes": {k: list(v) for k, v in self.shapes.items()}, "pool": pool,
            "numel": [self.total_numel_before_compression, self.total_numel_after_compression],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.iter = int(sd["iter"])
        self.matrix_approximation_rank = int(sd["rank"])
        self.h_ref, self.win = sd["h_ref"], list(sd["win"])
        self.rank_trace, self.entropy_trace, self.changes = list(sd["rank_trace"]), list(sd["entropy_trace"]), list(sd["changes"])
        name, keys, pos, has_gauss, cached = sd["rng"]
        self.rng.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
        self.shapes = {k: tuple(v) for k, v in sd["shapes"].items()}
        self.pool = {n: dict(v) for n, v in sd["pool"].items()}
        self.total_numel_before_compression, self.total_numel_after_compression = sd["numel"]
        self.layout, self.error_dict, self.p_memory_dict, self.q_memory_dict = {}, {}, {}, {}

    # ---- the window

    def close_step(self) -> None:
        """After each step's backward: record the step's entropy, and at a window's end choose the next rank."""
        t0 = time.perf_counter()
        was_compressing = self.iter - 1 >= self.start_powerSGD_iter  # the step that just ran (iter counts it already)
        self.rank_trace.append(self.rank if was_compressing else None)
        h = self.step_h[0] / self.step_h[1] if self.step_h[1] else None
        self.entropy_trace.append(h)
        self.step_h = [0.0, 0.0]
        if h is not None and was_compressing:  # warm-up steps are dense: not part of any window
            self.win[0] += h
            self.win[1] += 1
        if self.forced is not None:
            self.set_rank(self.forced)
            self.changes.append({"step": self.iter, "rank": self.rank, "why": "forced"})
            self.forced = None
        elif self.adapt and was_compressing and (self.iter - self.start_powerSGD_iter) % self.window == 0:
            h_win = _reduced_mean(self.win, self.process_group)
            self.win = [0.0, 0.0]
            if h_win is not None:
                self.h_ref = h_win if self.h_ref is None else max(self.h_ref, h_win)  # the peak window
                target = target_rank(h_win, self.h_ref, self.entropy_span, self.r_min, self.r_max)
                new = next_rank(self.rank, target, self.max_step)
                if new != self.rank:
                    self.changes.append({"step": self.iter, "rank": new, "entropy": h_win, "ref": self.h_ref, "target": target})
                    self.set_rank(new)
        self.monitor_s += time.perf_counter() - t0


def _reduced_mean(acc: list[float], group) -> float | None:
    """sum / count over every rank (all-reduced, so each rank holds the same float)."""
    t = torch.tensor(acc, dtype=torch.float64)
    if dist.is_initialized():
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
        t = t.to(dev)
        dist.all_reduce(t, group=group)
    s, n = float(t[0]), float(t[1])
    return s / n if n else None


# ------------------------------------------------------------------------------------ hooks


def _tensor_bytes(state: GradCompression, bucket, rank: int | None) -> tuple[float, float]:
    """(payload bytes, of which compressible matrices) of one bucket, dense (rank None) or under PowerSGD."""
    elem = bucket.buffer().element_size()
    total = matrix = 0
    for p in bucket.parameters():
        shape = tuple(p.shape)
        n = shape[0] if shape else 1
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        b = n * m * elem
        if rank is not None and len(shape) > 1:
            r = min(n, m, rank)
            if psgd._should_compress(n, m, r, state.min_rate)[0]:
                b = (n + m) * r * elem
        total += b
        if id(p) in state.matrix_ids:
            matrix += b
    return total, matrix


def allreduce_hook(state: GradCompression, bucket):
    """DDP's default all-reduce (average), counted."""
    total, matrix = _tensor_bytes(state, bucket, None)
    state.count(total * ring_factor(state.world), matrix * ring_factor(state.world))
    return default_hooks.allreduce_hook(None, bucket)


def zip_hook(state: GradCompression, bucket):
    """The lossless ZipCCL all-reduce (comm.collectives.zipccl_hook), counting the bytes it sends."""
    from llmcompress.comm.collectives import zipccl_hook

    total, matrix = _tensor_bytes(state, bucket, None)
    before = state.strategy.bytes_sent
    fut = zipccl_hook(state.strategy, bucket)
    sent = state.strategy.bytes_sent - before
    state.count(sent, sent * (matrix / total if total else 0.0))
    return fut


def edgc_hook(state: GradCompression, bucket):
    """torch's powerSGD_hook at the state's current rank, counted; with `adapt`, the reduced gradient's entropy
    is sampled every `sample_every`-th step."""
    ps: EDGCState = state.psgd
    ps.sync_layout(bucket)
    rank = ps.rank if ps.compressing else None
    step = ps.iter
    total, matrix = _tensor_bytes(state, bucket, rank)
    state.count(total * ring_factor(state.world), matrix * ring_factor(state.world))
    # torch chains the P and Q all-reduces in future callbacks; with several buckets in flight those can be
    # issued in a different order on different ranks (gloo then fails with a size mismatch, nccl hangs), so each
    # bucket completes here before the next one starts (on CPU there is no overlap to lose).
    out = psgd.powerSGD_hook(ps, bucket).wait()
    if ps.adapt and step % ps.sample_every == 0:
        t0 = time.perf_counter()
        off = 0
        for p in bucket.parameters():  # per matrix, so the figure does not depend on how DDP buckets them
            n = p.numel()
            if p.dim() >= 2:
                ps.step_h[0] += entropy_bits(out[off : off + n], ps.sample_fraction) * n
                ps.step_h[1] += n
            off += n
        ps.monitor_s += time.perf_counter() - t0
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(out)
    return fut


class GradCompression:
    """One scheme's DDP hook, its state and per-step byte accounting (`register`, then `end_step` every step).

    Args:
        scheme: none | zip | powersgd | edgc.
        model: the module DDP wraps (parameter names and the matrices' set come from it).
        rank: PowerSGD's fixed rank (`powersgd`); r_min / r_max: EDGC's range (it starts at r_max).
        start_iter: dense all-reduce steps before compression starts (>= 2; the same for powersgd and edgc).
        window / sample_every / sample_fraction / entropy_span / max_step: EDGC's monitor (see the module doc).
        carry_q: on a rank change keep the warm-start Q's leading columns instead of re-drawing it (see `set_rank`).
    """

    def __init__(self, scheme: str, model, *, rank: int = 8, r_min: int = 2, r_max: int = 32, start_iter: int = WARMUP,
                 window: int = 10, sample_every: int = 2, sample_fraction: float = 0.01, entropy_span: float = ENTROPY_SPAN,
                 max_step: int = 4, min_rate: float = 2.0, seed: int = 0, carry_q: bool = False):
        if scheme not in SCHEMES:
            raise ValueError(f"unknown gradient compression {scheme!r}; one of {', '.join(SCHEMES)}")
        self.scheme = scheme
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.min_rate = min_rate
        names = {id(p): n for n, p in model.named_parameters()}
        emb = set()
        for get in ("get_input_embeddings", "get_output_embeddings"):
            mod = getattr(model, get, lambda: None)()
            if mod is not None:
                emb |= {id(p) for p in mod.parameters()}
        self.matrix_ids = {id(p) for p in model.parameters() if p.dim() >= 2 and id(p) not in emb}
        self.psgd: EDGCState | None = None
        self.strategy = None
        if scheme in ("powersgd", "edgc"):
            self.psgd = EDGCState(rank=rank, r_min=r_min, r_max=r_max, adapt=scheme == "edgc", start_iter=start_iter,
                                  window=window, sample_every=sample_every, sample_fraction=sample_fraction,
                                  entropy_span=entropy_span, max_step=max_step, min_compression_rate=min_rate, seed=seed,
                                  carry_q=carry_q, names=names)
        elif scheme == "zip":
            from llmcompress.comm.collectives import Strategy

            self.strategy = Strategy(force="compressed", min_bytes=0)
        self._step = [0.0, 0.0]
        self.hook_s = 0.0
        self.total_bytes = 0
        self.total_matrix_bytes = 0
        self.steps = 0

    def count(self, total: float, matrix: float) -> None:
        self._step[0] += total
        self._step[1] += matrix

    def register(self, ddp, *, timed: bool = False) -> None:
        """Register this scheme's hook on `ddp` (a DDP model takes one hook). `timed`: each bucket completes inside
        the hook and the time spent there is added to `hook_s` (compression compute plus the transfer)."""
        hook = {"none": allreduce_hook, "zip": zip_hook, "powersgd": edgc_hook, "edgc": edgc_hook}[self.scheme]
        if not timed:
            ddp.register_comm_hook(self, hook)
            return

        def timed_hook(state, bucket):
            t0 = time.perf_counter()
            out = hook(state, bucket).wait()
            state.hook_s += time.perf_counter() - t0
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(out)
            return fut

        ddp.register_comm_hook(self, timed_hook)

    def end_step(self) -> dict[str, Any]:
        """Close one optimiser step (after backward): its bytes, and for EDGC the entropy/rank bookkeeping."""
        rec: dict[str, Any] = {"comm_bytes": int(round(self._step[0])), "comm_matrix_bytes": int(round(self._step[1]))}
        self.total_bytes += rec["comm_bytes"]
        self.total_matrix_bytes += rec["comm_matrix_bytes"]
        self._step = [0.0, 0.0]
        self.steps += 1
        if self.psgd is not None:
            ps = self.psgd
            before = ps.monitor_s
            ps.close_step()
            rec["grad_rank"] = ps.rank_trace[-1]
            if ps.adapt:
                rec["grad_entropy"] = ps.entropy_trace[-1]
                rec["monitor_s"] = round(ps.monitor_s - before, 6)
        return rec

    def summary(self) -> dict[str, Any]:
        out = {"grad_compress": self.scheme, "world_size": self.world, "comm_bytes": self.total_bytes,
               "comm_matrix_bytes": self.total_matrix_bytes, "comm_steps": self.steps}
        if self.psgd is not None:
            out.update(final_rank=self.psgd.rank, rank_changes=list(self.psgd.changes), monitor_s=round(self.psgd.monitor_s, 4))
            if self.psgd.adapt:
                out["entropy_ref"] = self.psgd.h_ref
        return out

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"scheme": self.scheme, "totals": [self.total_bytes, self.total_matrix_bytes, self.steps]}
        if self.psgd is not None:
            sd["psgd"] = self.psgd.state_dict()
            sd["monitor_s"] = self.psgd.monitor_s
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("scheme") != self.scheme:
            raise ValueError(f"checkpoint was trained with --grad-compress {sd.get('scheme')}, not {self.scheme}")
        self.total_bytes, self.total_matrix_bytes, self.steps = (int(x) for x in sd["totals"])
        if self.psgd is not None:
            self.psgd.load_state_dict(sd["psgd"])
            self.psgd.monitor_s = float(sd["monitor_s"])


def plot_traces(rank_trace: list, entropy_trace: list, path, title: str = "EDGC") -> None:
    """PNG of the rank (None = dense warm-up) and the sampled entropy over the steps (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llmcompress.io.atomic import atomic_path

    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = [i for i, r in enumerate(rank_trace) if r is not None]
    ax.step(xs, [rank_trace[i] for i in xs], where="post", color="tab:blue", label="rank")
    ax.set_xlabel("step")
    ax.set_ylabel("PowerSGD rank", color="tab:blue")
    ax2 = ax.twinx()
    es = [(i, h) for i, h in enumerate(entropy_trace) if h is not None]
    if es:
        ax2.plot([i for i, _ in es], [h for _, h in es], ".", ms=3, color="tab:orange", label="entropy")
    ax2.set_ylabel("gradient entropy (bits)", color="tab:orange")
    ax.set_title(title)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
