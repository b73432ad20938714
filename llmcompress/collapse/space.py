"""Search space: a candidate is a partition of the L layers into consecutive groups plus merge coefficients.

Genome (integers, length (L-1) + L*K):
  x[0:L-1]   cut bits: x[i] = 1 puts a group boundary between layer i and layer i+1;
  x[L-1:]    (L, K) indices into `alpha_grid`: the coefficients of layer j when it is merged into the
             leader of its group (K = 3 kinds: attention, mlp, norm; K = 1 when shared). Genes of group
             leaders are unused.
A group of one layer is the original layer unchanged, so the layer count is 1 + sum(cut bits).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
from pymoo.core.crossover import Crossover
from pymoo.core.mutation import Mutation
from pymoo.core.repair import Repair
from pymoo.core.sampling import Sampling

from llmcompress.collapse.config import KINDS


@dataclass(frozen=True)
class Candidate:
    """A decoded genome: groups of original layer indices and, per group, per merged layer, per kind, alpha."""

    groups: tuple[tuple[int, ...], ...]
    alphas: tuple[tuple[tuple[float, ...], ...], ...]  # alphas[g][j][k]: layer groups[g][j+1], kind KINDS[k]

    @property
    def n_layers(self) -> int:
        return len(self.groups)

    @property
    def key(self) -> tuple:
        return (self.groups, self.alphas)

    def alpha_dicts(self, g: int) -> list[dict[str, float]]:
        return [dict(zip(KINDS, a)) for a in self.alphas[g]]

    def first_changed(self) -> int | None:
        """Index of the first group that is not a single original layer (None: candidate = original)."""
        return next((i for i, grp in enumerate(self.groups) if len(grp) > 1), None)

    def layer_map(self) -> list[dict]:
        """[{"sources": [13, 14], "alpha": {"attention": [1.0], "mlp": [...], "norm": [...]}}, ...]."""
        out = []
        for g, grp in enumerate(self.groups):
            entry: dict = {"sources": list(grp)}
            if len(grp) > 1:
                entry["alpha"] = {k: [a[i] for a in self.alphas[g]] for i, k in enumerate(KINDS)}
            out.append(entry)
        return out

    def describe(self) -> str:
        parts = []
        for g, grp in enumerate(self.groups):
            if len(grp) == 1:
                continue
            a = self.alphas[g]
            if all(v == 0.0 for t in a for v in t):
                parts.append(f"drop{list(grp[1:])}")
            else:  # non-zero coefficients per absorbed layer: merge[15, 16, 17, 18](18 mlp 0.75), merge[3, 4](4 1)
                coef = []
                for j, t in enumerate(a):
                    if len(set(t)) == 1:
                        coef += [f"{grp[j + 1]} {t[0]:g}"] if t[0] != 0.0 else []
                    else:
                        coef += [f"{grp[j + 1]} {k} {v:g}" for k, v in zip(KINDS, t) if v != 0.0]
                parts.append(f"merge{list(grp)}({', '.join(coef)})")
        return " ".join(parts) or "original"

    @staticmethod
    def from_keep(n_layers: int, drop: list[int] | set[int]) -> Candidate:
        """Drop-only candidate: each dropped layer joins the group of the kept layer before it (alpha 0)."""
        drop = set(drop)
        if 0 in drop:
            raise ValueError("layer 0 cannot be dropped in this encoding (it leads the first group)")
        groups: list[list[int]] = []
        for i in range(n_layers):
            if i in drop:
                groups[-1].append(i)
            else:
                groups.append([i])
        zero = tuple(0.0 for _ in KINDS)
        return Candidate(tuple(tuple(g) for g in groups), tuple(tuple(zero for _ in g[1:]) for g in groups))


@dataclass
class Space:
    """Encoding, decoding and the feasibility rules of the search space."""

    n_layers: int
    alpha_grid: tuple[float, ...]
    per_kind: bool = True
    lo: int = 2
    hi: int = 2
    protect_first: int = 1
    protect_last: int = 1
    max_group: int = 4
    fixed_alpha: float | None = None  # drop-search: 0.0

    @property
    def n_kinds(self) -> int:
        return len(KINDS) if self.per_kind else 1

    @property
    def n_var(self) -> int:
        return (self.n_layers - 1) + self.n_layers * self.n_kinds

    @property
    def upper(self) -> np.ndarray:
        xu = np.full(self.n_var, len(self.alpha_grid) - 1)
        xu[: self.n_layers - 1] = 1
        return xu

    def min_reachable(self) -> int:
        """Fewest layers the rules allow (protected layers plus the middle in groups of max_group)."""
        pf, pl = self._protected()
        middle = self.n_layers - pf - pl
        return pf + pl + (-(-middle // self.max_group) if middle > 0 else 0)

    def _protected(self) -> tuple[int, int]:
        pf = min(self.protect_first, self.n_layers)
        pl = min(self.protect_last, self.n_layers - pf)
        return pf, pl

    def protected_bits(self) -> np.ndarray:
        """Bits forced to 1 so that protected layers stay groups of one."""
        pf, pl = self._protected()
        mask = np.zeros(self.n_layers - 1, dtype=bool)
        mask[: min(pf, self.n_layers - 1)] = True
        if pl:
            mask[self.n_layers - 1 - pl :] = True
        return mask

    def decode(self, x: np.ndarray) -> Candidate:
        L = self.n_layers
        x = np.asarray(x).astype(int)
        bits = x[: L - 1]
        genes = x[L - 1 :].reshape(L, self.n_kinds)
        groups, cur = [], [0]
        for i in range(1, L):
            if bits[i - 1]:
                groups.append(cur)
                cur = [i]
            else:
                cur.append(i)
        groups.append(cur)
        alphas = []
        for grp in groups:
            per = []
            for j in grp[1:]:
                vals = tuple(self.alpha_grid[int(v)] for v in genes[j])
                per.append(vals * len(KINDS) if self.n_kinds == 1 else vals)
            alphas.append(tuple(per))
        return Candidate(tuple(tuple(g) for g in groups), tuple(alphas))

    def encode(self, cand: Candidate) -> np.ndarray:
        L = self.n_layers
        x = np.zeros(self.n_var, dtype=int)
        grid = np.asarray(self.alpha_grid)
        genes = np.zeros((L, self.n_kinds), dtype=int)
        for g, grp in enumerate(cand.groups):
            if grp[0] > 0:
                x[grp[0] - 1] = 1
            for j, layer in enumerate(grp[1:]):
                vals = cand.alphas[g][j][: self.n_kinds]
                genes[layer] = [int(np.argmin(np.abs(grid - v))) for v in vals]
        x[L - 1 :] = genes.reshape(-1)
        return x

    def repair_one(self, x: np.ndarray) -> np.ndarray:
        """Make a genome feasible: protected layers alone, groups <= max_group, layer count in [lo, hi]."""
        L = self.n_layers
        x = np.asarray(x).astype(int).copy()
        rng = np.random.default_rng(zlib.crc32(x.tobytes()))  # deterministic: same genome, same repair
        bits = x[: L - 1]
        protected = self.protected_bits()
        bits[protected] = 1
        self._split_long_groups(bits, rng)
        free = np.flatnonzero(~protected)
        while 1 + bits.sum() > self.hi:
            ones = [i for i in free if bits[i] and self._can_remove_cut(bits, i)]
            if not ones:  # stuck on group sizes: re-partition the free middle into the allowed count
                self._repartition(bits, self.hi, rng)
                break
            bits[rng.choice(ones)] = 0
        while 1 + bits.sum() < self.lo:
            zeros = [i for i in free if not bits[i]]
            if not zeros:
                break
            bits[rng.choice(zeros)] = 1
        x[: L - 1] = bits
        if self.fixed_alpha is not None:
            idx = int(np.argmin(np.abs(np.asarray(self.alpha_grid) - self.fixed_alpha)))
            x[L - 1 :] = idx
        return x

    def _repartition(self, bits: np.ndarray, n_groups: int, rng) -> None:
        """Cut the unprotected middle into groups (each <= max_group) so the total is n_groups, if possible."""
        pf, pl = self._protected()
        middle = self.n_layers - pf - pl
        m = n_groups - pf - pl
        if middle <= 0 or m < 1 or m * self.max_group < middle:
            return
        sizes = [1] * m
        for _ in range(middle - m):
            open_ = [i for i in range(m) if sizes[i] < self.max_group]
            sizes[int(rng.choice(open_))] += 1
        bits[pf : self.n_layers - 1 - pl] = 0
        pos = pf
        for size in sizes[:-1]:
            pos += size
            bits[pos - 1] = 1

    def _group_sizes_around(self, bits: np.ndarray, i: int) -> tuple[int, int]:
        left = 1
        j = i - 1
        while j >= 0 and not bits[j]:
            left, j = left + 1, j - 1
        right = 1
        j = i + 1
        while j < len(bits) and not bits[j]:
            right, j = right + 1, j + 1
        return left, right

    def _can_remove_cut(self, bits: np.ndarray, i: int) -> bool:
        left, right = self._group_sizes_around(bits, i)
        return left + right <= self.max_group

    def _split_long_groups(self, bits: np.ndarray, rng) -> None:
        run_start = 0
        for i in range(len(bits) + 1):
            if i == len(bits) or bits[i]:
                size = i - run_start + 1
                while size > self.max_group:
                    cut = run_start + int(rng.integers(0, size - 1))
                    if bits[cut]:
                        continue
                    bits[cut] = 1
                    self._split_long_groups(bits, rng)
                    return
                run_start = i + 1

    def random_alpha(self, rng, size) -> np.ndarray:
        """Alpha gene indices, biased to the endpoints (0: drop, 1: replace) that work best in practice."""
        n = len(self.alpha_grid)
        i0, i1 = self.alpha_grid.index(0.0), self.alpha_grid.index(1.0)
        p = np.full(n, 0.2 / max(1, n - 2))
        p[i0], p[i1] = 0.5, 0.3
        p /= p.sum()
        return rng.choice(n, size=size, p=p)

    def random_genome(self, rng, n_groups: int | None = None) -> np.ndarray:
        L = self.n_layers
        x = np.zeros(self.n_var, dtype=int)
        n_groups = n_groups or int(rng.integers(self.lo, self.hi + 1))
        cuts = rng.choice(L - 1, size=min(L - 1, max(0, n_groups - 1)), replace=False)
        x[cuts] = 1
        x[L - 1 :] = self.random_alpha(rng, L * self.n_kinds)
        return self.repair_one(x)

    def mutate_one(self, x: np.ndarray, rng, p_move: float, p_flip: float, p_alpha: float) -> np.ndarray:
        L = self.n_layers
        x = x.copy()
        bits = x[: L - 1]
        free = np.flatnonzero(~self.protected_bits())
        changed = False
        if len(free) and rng.random() < p_move:
            ones, zeros = free[bits[free] == 1], free[bits[free] == 0]
            if len(ones) and len(zeros):
                i = int(rng.choice(ones))
                if rng.random() < 0.5:  # local: shift the cut by one layer
                    near = [j for j in (i - 1, i + 1) if j in set(zeros.tolist())]
                    j = int(rng.choice(near)) if near else int(rng.choice(zeros))
                else:
                    j = int(rng.choice(zeros))
                bits[i], bits[j] = 0, 1
                changed = True
        if len(free) and rng.random() < p_flip:
            i = int(rng.choice(free))
            bits[i] = 1 - bits[i]
            changed = True
        genes = x[L - 1 :]
        hit = rng.random(genes.shape) < p_alpha
        if hit.any():
            genes[hit] = self.random_alpha(rng, int(hit.sum()))
            changed = True
        if not changed and len(free):
            i = int(rng.choice(free))
            bits[i] = 1 - bits[i]
        return x


class SeededSampling(Sampling):
    """Initial population: the seeds (e.g. baselines) first, then mutated copies of them, then random genomes."""

    def __init__(self, space: Space, seeds: list[np.ndarray], p_random: float = 0.25) -> None:
        super().__init__()
        self.space, self.seeds, self.p_random = space, [np.asarray(s) for s in seeds], p_random

    def _do(self, problem, n_samples, random_state=None, **kwargs):
        rng = random_state
        sp = self.space
        rows = [sp.repair_one(s) for s in self.seeds[:n_samples]]
        while len(rows) < n_samples:
            if self.seeds and rng.random() >= self.p_random:
                x = self.seeds[int(rng.integers(len(self.seeds)))]
                for _ in range(int(rng.integers(1, 4))):
                    x = sp.mutate_one(x, rng, 1.0, 0.3, 0.05)
                rows.append(sp.repair_one(x))
            else:
                rows.append(sp.random_genome(rng))
        return np.array(rows, dtype=int)


class LayerCrossover(Crossover):
    """One-point crossover at a layer boundary: cut bits and alpha genes of a layer travel together."""

    def __init__(self, space: Space, prob: float = 0.7) -> None:
        super().__init__(2, 2, prob=prob)
        self.space = space

    def _do(self, problem, X, random_state=None, **kwargs):
        L, K = self.space.n_layers, self.space.n_kinds
        _, n_matings, n_var = X.shape
        Y = X.copy()
        for m in range(n_matings):
            c = int(random_state.integers(1, L))
            a, b = X[0, m], X[1, m]
            for src, dst in ((b, 0), (a, 1)):
                Y[dst, m, c - 1 : L - 1] = src[c - 1 : L - 1]
                Y[dst, m, L - 1 + c * K :] = src[L - 1 + c * K :]
        return Y


class LayerMutation(Mutation):
    """Move, add or remove a cut; resample alpha genes (endpoint-biased)."""

    def __init__(self, space: Space, p_move: float, p_flip: float, p_alpha: float) -> None:
        super().__init__(prob=1.0)
        self.space, self.p_move, self.p_flip, self.p_alpha = space, p_move, p_flip, p_alpha

    def _do(self, problem, X, random_state=None, **kwargs):
        return np.array([self.space.mutate_one(x, random_state, self.p_move, self.p_flip, self.p_alpha) for x in X])


class BudgetRepair(Repair):
    """Enforce the layer budget and the structural rules (see Space.repair_one)."""

    def __init__(self, space: Space) -> None:
        super().__init__()
        self.space = space

    def _do(self, problem, X, **kwargs):
        return np.array([self.space.repair_one(x) for x in X])
