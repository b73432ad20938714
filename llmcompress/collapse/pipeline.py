"""The `llmcompress collapse` pipeline: data -> cached references -> baselines -> search -> selection -> outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcompress.collapse.config import CollapseConfig
from llmcompress.errors import UserError


@dataclass
class Job:
    """One collapse run, as the steps of `run_collapse` pass it along: its settings, where it writes, and what
    it has loaded or measured so far."""

    cfg: CollapseConfig
    out_dir: Path
    overwrite: bool = False
    resume: bool = False
    stop_after: int | None = None
    lm: Any = None
    dev: Any = None
    info: Any = None  # collapse/parallel.py: this process's place under torchrun
    dtype: Any = None
    ev: Any = None  # the Evaluator (collapse/fitness.py)
    lo: int = 0  # the layer counts the search may reach
    hi: int = 0
    evaluation: dict | None = None  # which corpora the quality measures read (`_evaluation_sources`)
    plan: str | None = None  # --budget-minutes: the sizes chosen
    max_memory: int | None = None  # --max-memory in bytes (None: the memory available)
    runner: Any = None  # io/stream.py LayerRunner when the model is streamed (larger than max_memory)


@dataclass
class CollapseResult:
    out_dir: Path
    front: list[dict]
    baselines: list[dict]
    saved: list[Path] = field(default_factory=list)
    evals_per_s: float = float("nan")
    search_seconds: float = 0.0


def stale_files() -> tuple[str, ...]:
    """What a collapse run keeps for --resume and its log: removed by --overwrite (io/rundir.py)."""
    from llmcompress.collapse import refine, search, tune

    return (search.STATE_FILE, search.LEGACY_STATE_FILE, search.LOG_FILE, refine.STATE_FILE, tune.STATE_FILE)


def baseline_candidates(cfg: CollapseConfig, ev, counts: list[int], lo: int) -> dict[str, dict[int, object]]:
    """method -> {layers: candidate} for the configured baselines."""
    from llmcompress.collapse import baselines as B

    methods = set(cfg.baselines) | ({cfg.method} if cfg.method in ("shortgpt", "laco") else set())
    out: dict[str, dict[int, object]] = {}
    if "shortgpt" in methods:
        scores = B.shortgpt_scores(ev)
        out["shortgpt"] = {n: B.shortgpt(ev, n, scores) for n in counts}
    if "laco" in methods:
        path = B.laco(ev, lo, threshold=cfg.laco_threshold, n_blocks=min(cfg.laco_blocks, ev.refs["calib"].n_blocks),
                      protect_first=cfg.protect_first, protect_last=cfg.protect_last)
        out["laco"] = {n: c for n, c in path.items() if n in counts or n == lo}
    return out


def _record(ev, name, method, cand):
    from llmcompress.collapse.export import solution_record

    return solution_record(name, cand, ev.evaluate(cand), ev.evaluate(cand, "val"), method=method)


def run_collapse(cfg: CollapseConfig, out_dir: Path, *, overwrite: bool = False, resume: bool = False, lm=None, stop_after=None,
                 device: str = "cpu", dtype=None, max_memory: int | None = None) -> CollapseResult:
    """Run a collapse search (or a baseline) and write every output under `out_dir`.

    Args:
        cfg: the run's configuration (validated here against the model's depth).
        out_dir: output directory (must be new unless overwrite/resume).
        lm: an already loaded `LoadedModel` (else `cfg.model` is loaded).
        stop_after: stop the search after this generation (simulates an interruption).
        device: where the model, its cached states and every candidate run ("cpu", "cuda[:N]", "auto").
        dtype: torch dtype the model is loaded and run in (None: float32; the CLI resolves --dtype).
        max_memory: bytes the model may take (None: the memory available; 0: always stream). A safetensors
            model larger than it is streamed layer by layer (`io.stream.should_stream`, said on stderr): the
            references, every candidate's fitness, the report's perplexities and the checkpoints are computed
            from its layers read one group at a time (collapse/stream.py); coefficient tuning and PIQA,
            which need the whole model, are skipped with a notice.
    """
    from llmcompress.dist import from_env, leave
    from llmcompress.runtime import resolve_device

    out_dir = Path(out_dir)
    cfg.validate()
    dev, _ = resolve_device(device)
    info = from_env(dev.type)  # under torchrun: each rank scores a slice of every population; rank 0 writes
    try:
        return _run_collapse(Job(cfg, out_dir, overwrite, resume, stop_after, lm=lm, dev=dev, info=info, dtype=dtype, max_memory=max_memory))
    finally:
        leave(info)  # no barrier: the other ranks stop after the search, rank 0 goes on


def _run_collapse(job: Job) -> CollapseResult:
    from llmcompress.io.load import load_model
    from llmcompress.io.rundir import claim

    if job.lm is None:  # above the memory budget: a streamed skeleton (says so), before anything is written
        job.lm, job.runner = _open_streamed(job)
    try:
        run_dir = claim(job.out_dir, overwrite=job.overwrite, resume=job.resume, stale=stale_files()) if job.info.is_main else None
        job.lm = job.lm or load_model(job.cfg.model, device=job.dev, dtype=job.dtype)
        return _prepared(job, run_dir)
    finally:
        if job.runner is not None:
            job.runner.close()


def _open_streamed(job: Job):
    """(LoadedModel over a streamed skeleton, its LayerRunner) when the model is above the memory budget
    (`io.stream.should_stream` says so on stderr), else (None, None)."""
    import sys

    import torch

    from llmcompress.io.stream import open_streamed, should_stream

    cfg = job.cfg
    dtype = job.dtype or torch.float32
    path = should_stream(cfg.model, dtype, job.dev, job.max_memory, what="the collapse search")
    if path is None:
        return None, None
    if cfg.method == "gelaco" and cfg.tune_steps > 0 and job.info.is_main:
        print("notice: merge-coefficient tuning is skipped when streamed (it back-propagates through every layer after "
              "the first changed one at once)", file=sys.stderr)
    return open_streamed(cfg.model, path, dtype=dtype, device=job.dev, batch=cfg.batch_blocks)


def _prepared(job: Job, run_dir) -> CollapseResult:
    from llmcompress.collapse.fitness import STATES_PREFIX, prepare
    from llmcompress.collapse.search import load_state, make_space
    from llmcompress.io.atomic import write_json
    from llmcompress.io.rundir import clean
    from llmcompress.runtime import seed_everything

    out_dir, info, lm = job.out_dir, job.info, job.lm
    L = lm.model.config.num_hidden_layers
    job.cfg, job.plan = _sized(job, L)
    cfg = job.cfg
    cfg.validate(L)
    space = make_space(cfg, L)
    job.lo, job.hi = space.lo, space.hi
    lo = space.lo
    if lo < space.min_reachable():
        raise UserError(
            f"{lo} layers cannot be reached with max_group={cfg.max_group} and the protected layers",
            f"use {space.min_reachable()} layers or more, or raise max_group",
        )
    if job.resume:
        load_state(out_dir, cfg, cfg.model)  # wrong model/config: one-line error before any work
    seed_everything(cfg.seed)
    if info.is_main:
        run_dir.start()
        clean(out_dir, [STATES_PREFIX + "*"])  # states spilled to disk by a killed run: never reused, even on --resume
    info.barrier()  # the other ranks spill their states into out_dir too (each its own temp dir)
    job.evaluation = _evaluation_sources(cfg) if info.is_main else None
    job.ev = prepare(cfg, lm, cache_dir=out_dir, runner=job.runner)  # reads the calibration data: bad data fails before anything is written
    if info.is_main:
        write_json(out_dir / "config.json", cfg.to_dict())
    try:
        return _run(job)
    finally:
        job.ev.close()


def _sized(job: Job, L: int):
    """`--budget-minutes`: the config with tokens, population, generations, walk and tuning sized to the budget
    (budget.py), and the plan's description for the report; a resumed run keeps the sizes it started with."""
    import dataclasses
    import json
    import sys

    cfg, lm, info = job.cfg, job.lm, job.info
    if cfg.budget_minutes is None:
        return cfg, None
    from llmcompress.collapse import budget

    saved = Path(job.out_dir) / "config.json"
    if job.resume and saved.is_file():
        old = json.loads(saved.read_text())
        settings = {k: old[k] for k in budget.LADDER[0] if k in old}
        return dataclasses.replace(cfg, **settings), f"--budget-minutes {cfg.budget_minutes:g}: resumed with the sizes chosen at the start"
    sec = budget.measure(lm, cfg, runner=job.runner)
    sec = info.broadcast(sec)  # every rank sizes the search alike
    plan = budget.choose(cfg.budget_minutes, sec, n_layers=L, seq_len=cfg.seq_len, pareto=cfg.pareto, gelaco=cfg.method == "gelaco",
                         batch=cfg.batch_blocks)
    if info.is_main:
        print(plan.describe(), file=sys.stderr)
    return dataclasses.replace(cfg, **plan.settings), plan.describe()


def _evaluation_sources(cfg) -> dict:
    """Which corpora the final quality measures read. Without WikiText-2, perplexity is measured on held-out
    self text (said once, here, at the start, with how to get WikiText-2); without PIQA, PIQA is left out."""
    import sys

    from llmcompress.collapse.export import eval_corpus_reachable
    from llmcompress.data.sources import dataset_available, how_to_get

    out: dict = {"ppl_source": "wikitext2", "piqa_limit": cfg.piqa_limit, "piqa_note": None}
    if cfg.eval_tokens > 0 and not eval_corpus_reachable():
        out["ppl_source"] = "self"
        print(
            "notice: WikiText-2 is not here and the hub is unreachable: perplexity is measured on held-out text sampled "
            f"from the model instead (not comparable with published numbers). To get WikiText-2: {how_to_get('wikitext2')}",
            file=sys.stderr,
        )
    if cfg.piqa_limit > 0 and not dataset_available("piqa"):
        out["piqa_limit"] = 0
        out["piqa_note"] = f"not measured (dataset missing: {how_to_get('piqa')})"
    return out


def _tunes(cfg, streamed: bool = False) -> bool:
    """Whether the run tunes merge coefficients: gelaco with tuning steps, in memory (tuning back-propagates
    through every layer after the first changed one at once, which a streamed run never holds)."""
    return cfg.method == "gelaco" and cfg.tune_steps > 0 and not streamed


def _refine_picks(job: Job, picks, seeds, target):
    """Refine (swap and coefficient moves with racing, `refine.py`), then for gelaco tune the merge coefficients
    (`tune.py`), the picks at the layer counts that will be reported: the target, or in Pareto mode the counts
    `--save` chooses; each refined solution replaces its pick."""
    from llmcompress.collapse import export as E
    from llmcompress.collapse import tune as T
    from llmcompress.collapse.export import solution_record
    from llmcompress.collapse.refine import STATE_FILE, refine
    from llmcompress.collapse.search import make_space, nondominated
    from llmcompress.dist import is_main
    from llmcompress.progress import bar

    cfg, ev, out_dir = job.cfg, job.ev, job.out_dir
    if target is not None:
        counts = {target}
    else:
        records = nondominated([solution_record(f"{c.n_layers}L", c, f, v) for c, f, v in picks],
                               key=lambda r: (r["layers"], r["fitness_val"]))
        counts = {r["layers"] for r in E.choose_to_save(records, cfg.save)}
    space = make_space(cfg, ev.n_layers, seeds)
    out = []
    for c, f, v in picks:
        if c.n_layers not in counts:
            out.append((c, f, v))
            continue
        best = c
        if cfg.refine_steps > 0:
            phases = 1 if space.fixed_alpha is not None else 2  # swaps, then swaps + coefficient changes
            with bar(f"refine {c.n_layers} layers", total=phases * (cfg.refine_steps + 1)) as b:
                def tick(rec):
                    b.advance(info=f"calib {rec['fitness_calib']:.3f}" + (f" (val {rec['fitness_val']:.3f})" if "fitness_val" in rec else " local optimum"))

                best = refine(ev, space, c, steps=cfg.refine_steps, screen_blocks=cfg.refine_screen_blocks, top=cfg.refine_top,
                              state_path=out_dir / STATE_FILE, on_step=tick).best
        if _tunes(cfg, job.runner is not None) and best.first_changed() is not None and is_main():  # not a collective step: rank 0 alone
            with bar(f"tune {c.n_layers} layers", total=cfg.tune_steps) as b:
                tuned = T.tune(ev, best, steps=cfg.tune_steps, lr=cfg.tune_lr, per_kind=cfg.alpha_per_kind,
                               state_path=out_dir / T.STATE_FILE, on_step=lambda rec: b.advance(info=f"KL {rec['kl_batch']:.3f}"))
            best = tuned.best
        out.append((best, ev.evaluate(best), ev.evaluate(best, "val")))
    return out, counts


def _refined_text(cfg, refined: set[int], streamed: bool = False) -> str:
    if not refined:
        return ""
    text = f"; at {sorted(refined)} layers"
    if cfg.refine_steps > 0:
        moves = "swap moves, then swap or merge-coefficient moves" if cfg.method == "gelaco" else "swap moves"
        text += (f" refined by a walk of {moves} (up to {cfg.refine_steps} per phase, racing on "
                 f"{cfg.refine_screen_blocks} calibration blocks), the walk's best point on validation")
    if _tunes(cfg, streamed):
        text += (("," if cfg.refine_steps > 0 else "") + f" merge coefficients tuned by {cfg.tune_steps} Adam steps on the "
                 "calibration KL, kept where they lower the validation fitness")
    return text


def _settings_text(cfg, ev) -> str:
    """What produced the rows: the search's settings and the baselines' data."""
    n_cal, n_val = ev.refs["calib"].n_blocks, ev.refs["val"].n_blocks
    text = (f"{cfg.method} rows: {n_cal} calibration and {n_val} validation blocks of {cfg.seq_len} tokens, population {cfg.population}, "
            f"{cfg.generations} generations, walk {cfg.refine_steps} steps per phase / screen {cfg.refine_screen_blocks} blocks / top "
            f"{cfg.refine_top}, {cfg.tune_steps if cfg.method == 'gelaco' else 0} tuning steps, KL top-{cfg.kl_topk} every "
            f"{cfg.kl_stride}th position, candidate layers in {ev.compute_dtype} (fitness_dtype {cfg.fitness_dtype}), racing {'on' if cfg.racing else 'off'}, seed {cfg.seed}")
    return text + (f"; baseline rows: ShortGPT's Block Influence and LaCo (threshold {cfg.laco_threshold}, {cfg.laco_blocks} block) on "
                   f"the same calibration blocks")


def _streamed_text(cfg) -> str:
    return ("; streamed layer by layer from the safetensors files (the model is above the memory budget): references by one "
            "pass, each candidate's groups built from their source layers and run over every block in turn (racing has "
            "nothing to stop), the checkpoints written a group at a time" + (", no coefficient tuning" if cfg.method == "gelaco" and cfg.tune_steps > 0 else ""))


def _compare_counts(cfg, lo, hi, target) -> list[int]:
    if target is not None:
        return [target]
    step = max(1, (hi - lo) // 4)
    return sorted({hi, *range(lo, hi + 1, step)} | {lo})


def _run(job: Job) -> CollapseResult:
    from llmcompress.collapse import export as E
    from llmcompress.collapse.search import nondominated, run_search, select_by_validation
    from llmcompress.progress import bar

    cfg, lm, ev, out_dir, lo, hi = job.cfg, job.lm, job.ev, job.out_dir, job.lo, job.hi
    evaluation, plan = job.evaluation, job.plan
    L = ev.n_layers
    target = cfg.resolved_target(L)
    counts = list(range(lo, hi + 1)) if cfg.method in ("shortgpt", "laco") and cfg.pareto else _compare_counts(cfg, lo, hi, target)
    base = baseline_candidates(cfg, ev, sorted(set(counts) | set(_compare_counts(cfg, lo, hi, target))), lo)
    t0 = time.perf_counter()
    refined: set[int] = set()
    if cfg.method in ("gelaco", "drop-search"):
        seeds = [c for per in base.values() for c in per.values()]
        if cfg.method == "drop-search":
            seeds = [c for c in seeds if all(a == 0.0 for g in c.alphas for t in g for a in t)]
        # every seed enters the evaluator's archive, even those beyond the population size, so the
        # selection below can never pick worse (on calibration) than a baseline at the same layer count
        from llmcompress.collapse.parallel import evaluate_many
        from llmcompress.dist import world

        evaluate_many(ev, seeds)
        with bar(f"collapse {cfg.method}", total=cfg.generations + 1) as b:
            def tick(g):
                rec = g.record
                b.update(completed=g.gen + 1, info=f"gen {g.gen}  best KL {rec['best_kl_calib']:.3f} (val {rec['best_kl_val']:.3f})  {rec['evals_per_s']:.2f} evals/s")

            history = run_search(cfg, ev, seeds, out_dir, model_id=cfg.model, resume=job.resume, stop_after=job.stop_after, on_generation=tick)
        if job.stop_after is not None and history and history[-1].gen < cfg.generations:
            return CollapseResult(out_dir, [], [])
        picks = select_by_validation(ev, lo, hi)
        if (cfg.refine_steps > 0 or _tunes(cfg, job.runner is not None)) and picks:
            picks, refined = _refine_picks(job, picks, seeds, target)
        if not world().is_main:  # the other ranks' share ends with the last collective step
            return CollapseResult(out_dir, [], [])
    else:
        picks = [(c, ev.evaluate(c), ev.evaluate(c, "val")) for n, c in sorted(base[cfg.method].items()) if lo <= n <= hi]
    search_s = time.perf_counter() - t0
    records = [E.solution_record(f"{cfg.method}-{c.n_layers}L", c, f, v, method=cfg.method) for c, f, v in picks]
    if cfg.pareto:
        records = nondominated(records, key=lambda r: (r["layers"], r["fitness_val"]))
    cands = {f"{cfg.method}-{c.n_layers}L": c for c, _, _ in picks}
    chosen = E.choose_to_save(records, cfg.save)
    if cfg.save == "knee" and len(refined) == 1:  # the knee was refined: save the refined solution at its count
        chosen = [r for r in records if r["layers"] in refined] or chosen
    saved_counts = {r["layers"] for r in chosen}
    baseline_rows = [
        _record(ev, f"{m}-{n}L", m, c)
        for m, per in base.items() if m != cfg.method
        for n, c in sorted(per.items()) if n in set(_compare_counts(cfg, lo, hi, target)) | saved_counts
    ]
    # quality of the dense model, the chosen solutions and the baselines at the same layer counts
    evaluation = evaluation or {"ppl_source": "wikitext2", "piqa_limit": cfg.piqa_limit, "piqa_note": None}
    q = dict(eval_tokens=cfg.eval_tokens, seq_len=cfg.eval_seq_len, piqa_limit=evaluation["piqa_limit"])
    ppl_protocol = None
    runner = job.runner  # streamed: every quality measure and checkpoint from layers read a group at a time

    def quality(cand, **over):
        """The report's quality of `cand` (None: the dense model), built whole in memory or streamed."""
        if runner is not None:
            from llmcompress.collapse.stream import CollapsedRunner

            return E.quality_streamed(runner if cand is None else CollapsedRunner(runner, cand), lm.tokenizer,
                                      self_text=evaluation["ppl_source"] == "self", **{**q, **over})
        if cand is None:
            return E.quality(lm.model, lm.tokenizer, **{**q, **over})
        model = E.build_model(lm.model, cand)
        return E.quality(model, lm.tokenizer, **{**q, **over})

    if evaluation["ppl_source"] == "self" and runner is None:
        q["ppl_blocks"] = E.held_out_self_blocks(lm.model, lm.tokenizer, eval_tokens=cfg.eval_tokens, seq_len=cfg.eval_seq_len, seed=cfg.seed)
        n, seq = q["ppl_blocks"].shape
        ppl_protocol = (f"held-out self text: {n} sequences of {seq} tokens sampled from the dense model (seed {cfg.seed + E.HELD_OUT_SEED}, "
                        "disjoint from the calibration and validation text), each scored on its own; WikiText-2 was not reachable")
    dense = {"name": "dense", "layers": L, "params": ev.total_params, "kl_calib": 0.0, "kl_val": 0.0, "changes": "original",
             **quality(None)}
    from llmcompress.io.dtypes import save_dtype_for

    saved = []
    for r in chosen:
        path = out_dir / "models" / r["name"]
        save = dict(source=cfg.model, source_hash=lm.source_hash, config=cfg.to_dict(), overwrite=True, dtype=save_dtype_for(lm, cfg.save_dtype))
        if runner is not None:
            from llmcompress.collapse.stream import save_solution_streamed

            save_solution_streamed(runner, lm.tokenizer, cands[r["name"]], r, path, **save)
            r.update(quality(cands[r["name"]]))
        else:
            model = E.save_solution(lm.model, lm.tokenizer, cands[r["name"]], r, path, **save)
            r.update(E.quality(model, lm.tokenizer, **q))
            del model
        r["checkpoint"] = str(path)
        import json

        from llmcompress.io.checkpoint import MANIFEST

        saved_manifest = json.loads((path / MANIFEST).read_text())
        r["bytes_on_disk"], r["dtype"] = saved_manifest.get("bytes_on_disk"), saved_manifest.get("dtype")
        saved.append(path)
    for r in baseline_rows:
        if r["layers"] in saved_counts:
            r.update(quality(base[r["method"]][r["layers"]]))
        elif "ppl_blocks" in q:  # held-out self text is cheap and on hand: every row gets a perplexity (not PIQA)
            r.update(quality(base[r["method"]][r["layers"]], piqa_limit=0))
    meta = {
        "model": cfg.model, "method": cfg.method, "pareto": cfg.pareto, "population": cfg.population,
        "generations": cfg.generations, "seed": cfg.seed, "layers_original": L, "params_original": ev.total_params,
        "calibration": f"{ev.refs['calib'].label}, {cfg.calib_tokens} tokens",
        "validation": f"{ev.refs['val'].label}, {cfg.val_tokens} tokens (disjoint blocks)",
        "evaluations": ev.stats.evaluations, "evals_per_s": ev.stats.per_second, "search_seconds": search_s,
        "eval_tokens": cfg.eval_tokens, "eval_seq_len": cfg.eval_seq_len, "piqa_limit": cfg.piqa_limit,
        "ppl_source": evaluation["ppl_source"], "ppl_protocol": ppl_protocol, "piqa_note": evaluation["piqa_note"],
        "selection": "per layer count, best calibration candidates re-ranked by validation fitness" + _refined_text(cfg, refined, runner is not None),
        "settings": _settings_text(cfg, ev) + (_streamed_text(cfg) if runner is not None else ""), "budget": plan,
        "config": cfg.to_dict(),
    }
    E.write_front(out_dir, records, baseline_rows, meta)
    E.plot_front(out_dir / "pareto.png", records, baseline_rows, f"{cfg.model}: {cfg.method} vs baselines")
    E.write_report(out_dir / "report.md", [dense] + sorted(baseline_rows + chosen, key=lambda r: (-r["layers"], r["name"])), meta)
    return CollapseResult(out_dir, records, baseline_rows, saved, ev.stats.per_second, search_s)
