"""Drive the search with pymoo (GA for one layer budget, NSGA-II for a Pareto front), with atomic resume.

The pymoo Problem is thin: it decodes genomes and asks the Evaluator (which lives outside it). After every
generation the algorithm's state is written as JSON with temp+rename (`search_state.json`): the run's
fingerprint, the generation counters, the population (genomes, objectives and the per-individual data the
survival computed: NSGA-II's rank and crowding) and the numpy RNG state. `--resume` checks the fingerprint
first, then rebuilds a fresh pymoo algorithm from that population, so it continues from the last finished
generation and ends on the same front. Nothing is pickled: an output directory is shared, copied and
downloaded, and resuming one must never run code from it (pymoo has no serialisation of its own besides
pickle, hence this small hand-written one).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pymoo.core.problem import Problem

from llmcompress.collapse.config import CollapseConfig
from llmcompress.collapse.fitness import Evaluator, Fitness
from llmcompress.collapse.space import (
    BudgetRepair,
    Candidate,
    LayerCrossover,
    LayerMutation,
    SeededSampling,
    Space,
)
from llmcompress.errors import UserError

STATE_FILE = "search_state.json"
LEGACY_STATE_FILE = "search_state.pkl"  # written by llmcompress before 0.x: never read (pickle runs code)
STATE_FORMAT = "llmcompress-collapse-search-1"
LOG_FILE = "search_log.jsonl"
HV_REF_FITNESS = 3.0  # hypervolume reference point: (all layers, fitness 3.0 nats)


def survival_rule(parents_F: np.ndarray | None, n_survive: int, pareto: bool):
    """The racing rule of an offspring: callable(candidate) -> callable(lower bound) -> True when it cannot survive.

    pymoo's survival keeps `n_survive` of parents + offspring. An offspring whose fitness is surely worse than
    that of `n_survive` parents with no more layers is dominated by all of them (GA: ranked after all of
    them), so it ranks after a full population in every case: it is never kept, and neither the fronts
    that fill the population nor their crowding distances depend on its exact value (NSGA-II's rank of an
    individual depends only on the individuals that dominate it). Its evaluation may stop there. Only the
    parents decide (not offspring scored before it), so the rule is the same on every rank under torchrun.
    """
    if parents_F is None or len(parents_F) < n_survive:
        return None
    F = np.asarray(parents_F, dtype=float)

    def rule(cand: Candidate):
        fit = F[:, 1] if pareto else F[:, 0]
        fewer = F[:, 0] <= cand.n_layers if pareto else np.ones(len(F), dtype=bool)
        return lambda lb: int(np.sum(fewer & (fit < lb))) >= n_survive

    return rule


class CollapseProblem(Problem):
    """Minimize (layers, fitness) in Pareto mode, or fitness alone at a fixed budget.

    With `racing`, offspring are scored with the survival rule of the current parents (`survival_rule`): a
    pruned offspring gets its lower bound as fitness, which changes no survivor.
    """

    def __init__(self, space: Space, evaluator: Evaluator | None, pareto: bool, racing: bool = False) -> None:
        super().__init__(n_var=space.n_var, n_obj=2 if pareto else 1, xl=np.zeros(space.n_var), xu=space.upper, vtype=int)
        self.space, self.evaluator, self.pareto, self.racing = space, evaluator, pareto, racing
        self.algorithm = None  # set by run_search: the parents decide the racing rule

    def _evaluate(self, X, out, *args, **kwargs):
        from llmcompress.collapse.parallel import evaluate_many

        cands = [self.space.decode(x) for x in np.asarray(X).astype(int)]
        rule = None
        algo = self.algorithm
        if self.racing and algo is not None and algo.pop is not None and len(algo.pop) > 0:
            rule = survival_rule(algo.pop.get("F"), algo.pop_size, self.pareto)
        fits = evaluate_many(self.evaluator, cands, "calib", rule)
        rows = [[c.n_layers, f.fitness] if self.pareto else [f.fitness] for c, f in zip(cands, fits)]
        out["F"] = np.array(rows, dtype=float)


def make_space(cfg: CollapseConfig, n_layers: int, seeds: list[Candidate] | None = None) -> Space:
    """The search space of `cfg`; `max_group` grows to the largest group of any seed, so that repair never
    alters a seed (a ShortGPT drop set such as drop[12..15] is one group of 5 layers: with the default 4
    the seeded baselines were silently changed into worse candidates before the search began)."""
    lo, hi = cfg.layer_range(n_layers)
    max_group = max([cfg.max_group, *(len(g) for s in seeds or [] for g in s.groups)])
    return Space(
        n_layers=n_layers,
        alpha_grid=tuple(float(a) for a in cfg.alpha_grid),
        per_kind=cfg.alpha_per_kind,
        lo=lo,
        hi=hi,
        protect_first=cfg.protect_first,
        protect_last=cfg.protect_last,
        max_group=max_group,
        fixed_alpha=0.0 if cfg.method == "drop-search" else None,
    )


def tournament_by_fitness(pop, P, random_state=None, **kwargs):
    """Binary tournament of the single-objective GA: the lower fitness wins, ties at random.

    The same rule as pymoo's own `comp_by_cv_and_fitness` (the collapse problem has no constraints, so
    its CV branch never applies), but a plain module-level function (pymoo's is wrapped by a decorator).
    """
    from pymoo.operators.selection.tournament import compare

    S = np.full(P.shape[0], np.nan)
    for i in range(P.shape[0]):
        a, b = P[i, 0], P[i, 1]
        S[i] = compare(a, pop[a].F, b, pop[b].F, method="smaller_is_better", return_random_if_equal=True,
                       random_state=random_state)
    return S[:, None].astype(int)


def make_algorithm(cfg: CollapseConfig, space: Space, seeds: list[np.ndarray]):
    from pymoo.algorithms.moo.nsga2 import NSGA2
    from pymoo.algorithms.soo.nonconvex.ga import GA
    from pymoo.operators.selection.tournament import TournamentSelection

    kwargs = dict(
        pop_size=cfg.population,
        sampling=SeededSampling(space, seeds),
        crossover=LayerCrossover(space, prob=cfg.p_crossover),
        mutation=LayerMutation(space, cfg.p_cut_move, cfg.p_cut_flip, cfg.p_alpha),
        repair=BudgetRepair(space),
        eliminate_duplicates=True,
    )
    if cfg.pareto:
        return NSGA2(**kwargs)
    return GA(selection=TournamentSelection(func_comp=tournament_by_fitness), **kwargs)


@dataclass
class Generation:
    gen: int
    front: list[tuple[Candidate, Fitness, Fitness]]  # (candidate, calibration, validation)
    record: dict = field(default_factory=dict)


def hypervolume(points: list[tuple[float, float]], n_layers: int) -> float:
    """Hypervolume of (layers, fitness) points, layers scaled by the depth, reference (1, HV_REF_FITNESS)."""
    from pymoo.indicators.hv import HV

    if not points:
        return 0.0
    F = np.array([[layers / n_layers, fit] for layers, fit in points], dtype=float)
    return float(HV(ref_point=np.array([1.0, HV_REF_FITNESS]))(F))


def nondominated(items: list, key) -> list:
    """Items not dominated in the 2-D minimization key(item) -> (a, b); ties keep the first seen."""
    pts = [key(i) for i in items]
    out = []
    for i, p in enumerate(pts):
        dominated = any((q[0] <= p[0] and q[1] <= p[1]) and (q != p or j < i) for j, q in enumerate(pts) if j != i)
        if not dominated:
            out.append(items[i])
    return out


def current_front(algo, space: Space, evaluator: Evaluator, pareto: bool) -> list[tuple[Candidate, Fitness, Fitness]]:
    """The algorithm's optima (non-dominated, or the best), each with calibration and validation fitness."""
    seen, out = set(), []
    for ind in algo.opt:
        cand = space.decode(ind.X)
        if cand.key in seen:
            continue
        seen.add(cand.key)
        out.append((cand, evaluator.evaluate(cand), evaluator.evaluate(cand, "val")))
    out.sort(key=lambda t: (t[0].n_layers, t[1].fitness))
    return out if pareto else out[:1]


def _number(v):
    """A JSON-safe scalar (numpy scalars to Python; infinities and NaN as strings, which json rejects)."""
    v = v.item() if hasattr(v, "item") else v
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


def _lists(x):
    """A candidate key (nested tuples) as JSON-ready nested lists."""
    return [_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (tuple, list)) else x


def _unnumber(v):
    return float(v) if v in ("inf", "-inf", "nan") else v


def state_dict(algo, model_id: str, cfg: CollapseConfig, gen: int, evaluated: set = frozenset()) -> dict:
    """Everything `--resume` needs of a pymoo GA/NSGA-II after a finished generation, as plain JSON."""
    pop = algo.pop
    return {
        "format": STATE_FORMAT,
        "model": model_id,
        "fingerprint": cfg.fingerprint(),
        "gen": gen,
        "algorithm": type(algo).__name__,
        "n_iter": int(algo.n_iter),
        "n_eval": int(algo.evaluator.n_eval),
        "rng": algo.random_state.bit_generator.state,
        "X": pop.get("X").astype(int).tolist(),
        "F": [[_number(v) for v in row] for row in pop.get("F")],
        "data": [{k: _number(v) for k, v in ind.data.items()} for ind in pop],
        "evaluated": sorted(_lists(k) for k in evaluated),  # so a resumed run counts evaluations like an uninterrupted one
    }


def load_state(out_dir: Path, cfg: CollapseConfig, model_id: str) -> dict | None:
    """The JSON state of an interrupted run, after checking it was made for this model and config (the
    fingerprint is checked before any other field is used). None when there is none."""
    path = Path(out_dir) / STATE_FILE
    if not path.is_file():
        legacy = Path(out_dir) / LEGACY_STATE_FILE
        if legacy.is_file():
            raise UserError(
                f"{legacy} is a pickled search state, which llmcompress no longer reads (unpickling can run code)",
                "start the search afresh with --overwrite",
            )
        return None
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("not an llmcompress search state")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read the search state {path}: {str(exc).splitlines()[0][:120]}", "start afresh with --overwrite") from None
    if state.get("model") != model_id or state.get("fingerprint") != cfg.fingerprint():
        raise UserError(
            f"{out_dir} holds a search for another model or config ({state.get('model')})",
            "resume with the same model and settings, or choose another --out",
        )
    return state


def restore_algorithm(state: dict, algo, path: Path) -> None:
    """Put a set-up (never run) pymoo algorithm where the saved one was after its last generation."""
    from pymoo.core.population import Population

    try:
        if state["algorithm"] != type(algo).__name__:
            raise ValueError(f"state of a {state['algorithm']} run")
        X = np.asarray(state["X"], dtype=np.int64)
        F = np.asarray([[_unnumber(v) for v in row] for row in state["F"]], dtype=float)
        data = state["data"]
        if X.ndim != 2 or X.shape[1] != algo.problem.n_var or len(F) != len(X) or len(data) != len(X):
            raise ValueError("population of the wrong shape")
        pop = Population.new("X", X)
        pop.set("F", F)
        for ind, d in zip(pop, data):
            ind.data.update({k: _unnumber(v) for k, v in d.items()})
            ind.evaluated.update({"F", "G", "H"})
        algo.random_state.bit_generator.state = state["rng"]
        algo.pop = pop
        algo.n_iter = int(state["n_iter"])
        algo.evaluator.n_eval = int(state["n_eval"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"corrupt search state {path}: {exc}", "start afresh with --overwrite") from None
    algo.is_initialized = True
    algo.start_time = time.time()  # pymoo's result() reads it when the run ends
    algo._set_optimum()


def truncate_log(path: Path, last_gen: int) -> None:
    """Drop log lines of generations after `last_gen` (written before a crash, never checkpointed)."""
    import json

    from llmcompress.io.atomic import write_text

    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("gen", 0) <= last_gen]
    write_text(path, "".join(line + "\n" for line in keep))


def run_search(
    cfg: CollapseConfig,
    evaluator: Evaluator,
    seeds: list[Candidate],
    out_dir: Path,
    *,
    model_id: str,
    resume: bool = False,
    stop_after: int | None = None,
    on_generation=None,
) -> list[Generation]:
    """Run (or resume) the search; returns the per-generation fronts computed in this call.

    Args:
        stop_after: stop after this generation (tests use it to simulate an interruption).
        on_generation: callback(Generation) after each generation, e.g. a progress bar.
    """
    from pymoo.termination.max_gen import MaximumGenerationTermination

    from llmcompress.dist import is_main
    from llmcompress.io.atomic import append_jsonl, write_json

    main = is_main()  # under torchrun only rank 0 writes; every rank takes the same steps
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    space = make_space(cfg, evaluator.n_layers, seeds)
    state = load_state(out_dir, cfg, model_id) if resume else None
    algo = make_algorithm(cfg, space, [space.encode(s) for s in seeds])
    problem = CollapseProblem(space, evaluator, cfg.pareto, racing=cfg.racing)
    problem.algorithm = algo
    algo.setup(problem, termination=MaximumGenerationTermination(cfg.generations + 1), seed=cfg.seed, verbose=False)
    # candidates scored before an interruption: a resumed run counts evaluations as an uninterrupted one would
    evaluated = {_tuples(k) for k in state.get("evaluated", ())} if state is not None else set()
    if state is not None:
        restore_algorithm(state, algo, out_dir / STATE_FILE)
        if main:
            truncate_log(out_dir / LOG_FILE, algo.n_gen - 2)
    elif main:
        (out_dir / LOG_FILE).unlink(missing_ok=True)
    history = []
    while algo.has_next():
        algo.next()
        gen = algo.n_gen - 2  # pymoo counts the finished initial population as n_gen 2; ours is 0
        front = current_front(algo, space, evaluator, cfg.pareto)
        best = min(front, key=lambda t: t[1].fitness)
        record = {
            "gen": gen,
            "evaluations": len(evaluated | evaluator.calib_keys()),
            "evals_per_s": round(evaluator.stats.per_second, 4),
            "pruned": evaluator.stats.pruned,
            "best_fitness_calib": best[1].fitness,
            "best_fitness_val": best[2].fitness,
            "best_kl_calib": best[1].kl,
            "best_kl_val": best[2].kl,
            "hv_calib": hypervolume([(c.n_layers, f.fitness) for c, f, _ in front], evaluator.n_layers),
            "hv_val": hypervolume([(c.n_layers, v.fitness) for c, _, v in front], evaluator.n_layers),
            "front": [
                {"layers": c.n_layers, "fitness_calib": f.fitness, "fitness_val": v.fitness, "kl_calib": f.kl, "kl_val": v.kl}
                for c, f, v in front
            ],
        }
        evaluated |= evaluator.calib_keys()
        if main:
            append_jsonl(out_dir / LOG_FILE, record)
            write_json(out_dir / STATE_FILE, state_dict(algo, model_id, cfg, gen, evaluated))
        g = Generation(gen, front, record)
        history.append(g)
        if on_generation is not None:
            on_generation(g)
        if stop_after is not None and gen >= stop_after:
            break
    return history


def select_by_validation(evaluator: Evaluator, lo: int, hi: int, top: int = 2) -> list[tuple[Candidate, Fitness, Fitness]]:
    """Per layer count, the `top` best candidates on calibration, re-ranked by validation; one per count.

    Every candidate the search evaluated is considered (the evaluator's archive), so the saved solutions
    are chosen by a split the search never optimized on. Candidates that racing stopped early are finished
    only when their lower bound could still place them among the `top` at their count: the picks equal
    those of a search that scored every candidate in full.
    """
    from llmcompress.collapse.parallel import evaluate_many

    by_count: dict[int, list[Candidate]] = {}
    for cand in evaluator.archive.values():
        if lo <= cand.n_layers <= hi:
            by_count.setdefault(cand.n_layers, []).append(cand)
    while True:
        todo = []
        for cands in by_count.values():
            full = sorted(f.fitness for c in cands if (f := evaluator.known(c)) is not None)
            cut = full[top - 1] if len(full) >= top else math.inf
            todo += [c for c in cands if evaluator.known(c) is None and evaluator.lower_bound(c) <= cut]
        if not todo:
            break
        evaluate_many(evaluator, todo)
    ranked = {n: sorted(((c, evaluator.known(c)) for c in cands if evaluator.known(c) is not None), key=lambda t: t[1].fitness)[:top]
              for n, cands in by_count.items()}
    counts = sorted(ranked)
    # validation, with racing: the first of each count in full, then the others stop once their lower bound
    # reaches the best so far at their count (min keeps the first of equals, so such a one is never picked)
    best = {n: (ranked[n][0][0], ranked[n][0][1], v) for n, v in zip(counts, evaluate_many(evaluator, [ranked[n][0][0] for n in counts], "val"))}
    for j in range(1, top):
        rest = [(n, *ranked[n][j]) for n in counts if len(ranked[n]) > j]
        rule = lambda c: (lambda lb, b=best[c.n_layers][2].fitness: lb >= b)  # noqa: E731
        for (n, c, f), v in zip(rest, evaluate_many(evaluator, [c for _, c, _ in rest], "val", rule)):
            if not v.partial and v.fitness < best[n][2].fitness:
                best[n] = (c, f, v)
    return [best[n] for n in counts]
