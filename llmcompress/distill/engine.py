"""Orchestration: plan the student, cache teacher features, train segments (curriculum), or run e2e.

`distill(cfg, out)` is the single entry point (the CLI and torchrun call it). Layer-wise mode:

1. load the teacher and the training blocks; plan the student (removal: uniform / Block Influence keep
   list; or a checkpoint's `layer_map`); lay out segments;
2. compute the teacher's boundary features once (micro-batched) into a sharded cache keyed by
   (teacher, data, boundaries, dtype); free the teacher (removal students are cut from it in place);
3. phase 1: segments in difficulty order, on teacher inputs (spread over ranks when distributed);
4. phase 2 (rank 0): segments in network order, inputs mixed from teacher features to the student
   prefix's own outputs on a schedule; after each segment its outputs are propagated into a student
   feature cache for the next one;
5. optional end-to-end logit KL steps from the cached final teacher states; save, evaluate, report.

Every finished segment's weights and the run state are written atomically under `OUT/work/`, so
`resume=True` continues from the last finished segment.
"""

from __future__ import annotations

import copy
import gc
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcompress.dist import DistInfo
from llmcompress.distill import curriculum as cur
from llmcompress.distill import losses
from llmcompress.distill.cache import (
    FeatureCache,
    build_teacher_cache,
    cache_key,
    prefetch,
    torch_dtype,
)
from llmcompress.distill.config import DistillConfig, Mode
from llmcompress.distill.plan import load_blocks, plan_student, prepare_out
from llmcompress.distill.run import BEFORE_PPL, TEACHER_PPL, Run, eval_ppl
from llmcompress.distill.segments import (
    Segment,
    segment_layout,
    teacher_boundaries,
)
from llmcompress.distill.stream import ppl_streamed
from llmcompress.eval.report import WIKITEXT2_PPL
from llmcompress.io.atomic import append_jsonl, atomic_path, write_json
from llmcompress.io.rundir import load_state, save_state
from llmcompress.io.stream import available_memory


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class DistillResult:
    out_dir: Path
    student_dir: Path | None
    layer_map: list[dict]
    segments: list[Segment]
    metrics: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- training


def _forward_segment(run: Run, seg: Segment, x):
    from llmcompress.io.forward import run_layers

    return run_layers(run.model, x, run.layers(seg), seg.student_layers, output="hidden")


def _segment_loss(run: Run, seg: Segment, x, y, *, step_seed: int, with_kl: bool = True, ids=None):
    """Hidden loss of segment `seg` on input x vs teacher target y, plus logit KL for the last segment.

    With `cfg.ce_weight` > 0 and the block's token `ids`, the last segment also gets the next-token
    cross-entropy on the same sampled positions (those before the block's last token).
    """
    import torch

    cfg = run.cfg
    with run.autocast():
        out = _forward_segment(run, seg, x)
    loss = losses.hidden_loss(cfg.hidden_loss.value, out, y)
    parts = {"hidden": float(loss.detach())}
    last = with_kl and seg.index == len(run.segments) - 1
    use_ce = last and cfg.ce_weight > 0 and ids is not None
    if last and (cfg.kl_weight > 0 or use_ce):
        t = y.shape[1]
        t_pos = t - 1 if use_ce else t  # CE needs the next token
        n = max(1, round(cfg.kl_positions * t_pos))
        pos = torch.randperm(t_pos, generator=torch.Generator().manual_seed(step_seed))[:n].sort().values.to(y.device)
        with run.autocast():
            s_logits = run.head(run.norm(out[:, pos]))
        if cfg.kl_weight > 0:
            with torch.no_grad(), run.autocast():
                t_logits = run.head(run.norm(y[:, pos]))
            kl = losses.kl_logits(s_logits, t_logits, cfg.kl_temperature)
            parts["kl"] = float(kl.detach())
            loss = loss + cfg.kl_weight * kl
        if use_ce:
            ce = losses.next_token_ce(s_logits, ids.to(y.device)[:, pos + 1])
            parts["ce"] = float(ce.detach())
            loss = loss + cfg.ce_weight * ce
    return loss, parts


def _to(t, run: Run):
    """A feature batch on the device in the training dtype (streamed: the runner's compute dtype; a resident
    tensor such as the embedding may be narrower)."""
    dtype = run.streamed.dtype if run.streamed is not None else next(run.model.parameters()).dtype
    return t.to(run.device, dtype=dtype)


def _student_cache(run: Run, level: int) -> FeatureCache:
    return FeatureCache(run.work / f"student-features-{level}")


def _loader(run: Run, seg: Segment, phase: int):
    """Shard index -> (input, student input or None, target, token ids or None).

    Phase 2 loads the student's own input too; the last segment loads the token ids when the loss has a
    cross-entropy term.
    """
    k = seg.index
    teacher = run.teacher
    student = _student_cache(run, k) if phase == 2 and k > 0 else None
    names = [f"b{k}", f"b{k + 1}"] + (["ids"] if run.cfg.ce_weight > 0 and k == len(run.segments) - 1 else [])

    def load(i: int):
        t = teacher.read(i, names)
        s = student.read(i - run.state["phase2_first_shard"], ["h"])["h"] if student is not None else None
        return t[f"b{k}"], s, t[f"b{k + 1}"], t.get("ids")

    return load


def _train_segment(run: Run, seg: Segment, *, phase: int, steps: int, shards: list[int]) -> list[float]:
    import torch

    from llmcompress.progress import bar

    cfg = run.cfg
    torch.manual_seed(cfg.seed * 1000 + 10 * seg.index + phase)
    params = [p for layer in run.layers(seg) for p in layer.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    order = cur.epoch_order(len(shards), steps, seed=cfg.seed * 1000 + 10 * seg.index + phase)
    history = []
    from llmcompress.actcomp.layer import summary, training
    from llmcompress.actcomp.optim import stepper

    t0 = time.perf_counter()
    with bar(f"phase {phase} segment {seg.index}", total=steps) as b, \
            training(run.layers(seg), cfg.act_rank, budget=cfg.act_budget, seed=cfg.seed * 1000 + 10 * seg.index + phase,
                     co_compress=cfg.act_grad == "factored") as ac:
        stepped = stepper(opt, ac)  # opt, or its FactoredStep (--act-grad factored)
        batches = prefetch(_loader(run, seg, phase), [shards[j] for j in order], depth=cfg.prefetch)
        for step, (x_t, x_s, y, ids) in enumerate(batches):
            ac.set_step(step)
            alpha = cur.mix_weight(step, steps, cfg.mix_start, cfg.mix_end) if x_s is not None else 0.0
            x = cur.mix_inputs(_to(x_t, run), _to(x_s, run), alpha) if x_s is not None else _to(x_t, run)
            for g in opt.param_groups:
                g["lr"] = cur.lr_at(step, steps, cfg.learning_rate)
            loss, parts = _segment_loss(run, seg, x, _to(y, run), step_seed=cfg.seed * 100003 + step * 101 + seg.index, ids=ids)
            losses.optimizer_step(stepped, params, loss)
            history.append(loss.item())
            run.log({"phase": phase, "segment": seg.index, "step": step, "loss": loss.item(), **parts, "mix": round(alpha, 4)})
            b.advance(info=f"loss={loss.item():.4f}")
        run.state["activations"] = summary(ac, steps, time.perf_counter() - t0, run.state.get("activations"))
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    return history


def _segment_file(run: Run, seg: Segment, phase: int) -> Path:
    return run.work / f"segment-{seg.index:03d}-phase{phase}.safetensors"


def _segment_state(run: Run, seg: Segment) -> dict:
    return {f"{i}.{k}": v.detach().cpu().contiguous() for i, layer in enumerate(run.layers(seg)) for k, v in layer.state_dict().items()}


def _save_segment(run: Run, seg: Segment, phase: int, tensors: dict) -> None:
    from safetensors.torch import save_file

    with atomic_path(_segment_file(run, seg, phase)) as tmp:
        save_file(tensors, str(tmp))


def _load_segment(run: Run, seg: Segment, phase: int) -> None:
    """The segment's weights from its phase file (streamed: read from it whenever the segment is loaded)."""
    from safetensors.torch import load_file

    if run.streamed is not None:
        run.streamed.use_segment(_segment_file(run, seg, phase), seg.student_start, seg.student_end - seg.student_start)
        return
    tensors = load_file(str(_segment_file(run, seg, phase)))
    for i, layer in enumerate(run.layers(seg)):
        sd = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == str(i)}
        layer.load_state_dict(sd)


def _initial_losses(run: Run, shard: int) -> dict[int, float]:
    """Difficulty of each segment: its hidden loss on one batch of teacher inputs, before training."""
    import torch

    out = {}
    with torch.no_grad():
        for seg in run.segments:
            x, _, y, _ = _loader(run, seg, 1)(shard)
            with run.materialized(seg):
                loss, _ = _segment_loss(run, seg, _to(x, run), _to(y, run), step_seed=0, with_kl=False)
            out[seg.index] = loss.item()
    return out


def _phase1(run: Run, steps: int, shards: list[int]) -> None:
    """Difficulty order, teacher inputs; each rank trains its share, rank 0 saves every segment.

    In rounds: each rank trains its next segment, the round's segments (and logs) are gathered to rank 0, which
    saves them before the next round. So rank 0 holds at most one segment per rank (a streamed student is never
    gathered whole) and an interrupted distributed run keeps every finished round for `--resume`."""
    order = run.state["order"]
    shares = cur.assign_ranks(order, run.dist.world_size, {s.index: s.student_end - s.student_start for s in run.segments})
    done = set(run.state["phase1_done"])
    todo = {r: [k for k in ks if k not in done] for r, ks in shares.items()}
    mine = todo[run.dist.rank]
    for i in range(max(len(ks) for ks in todo.values())):
        k, tensors = (mine[i] if i < len(mine) else None), None
        if k is not None:
            seg = run.segments[k]
            with run.materialized(seg):
                _train_segment(run, seg, phase=1, steps=steps, shards=shards)
                tensors = _segment_state(run, seg)
        gathered = run.dist.gather(((k, tensors), run.log_buffer))  # [this one] in a single process
        run.log_buffer = []
        if run.dist.is_main:
            for (j, part), records in gathered:
                for rec in records:
                    append_jsonl(run.out / "train_log.jsonl", rec)
                if j is not None:
                    _save_segment(run, run.segments[j], 1, part)
                    run.state["phase1_done"].append(j)
            run.save_state()
        del gathered, tensors
        run.dist.barrier()
    for k in sorted(run.state["phase1_done"] if run.dist.is_main else []):
        _load_segment(run, run.segments[k], 1)


def _propagate(run: Run, seg: Segment, shards: list[int]) -> None:
    """Student features after segment `seg`, from the student's own features before it (phase 2 shards)."""
    import torch

    from llmcompress.progress import track

    src = _student_cache(run, seg.index) if seg.index > 0 else None
    dst = _student_cache(run, seg.index + 1)
    dtype = torch_dtype(run.cfg.cache_dtype.value)
    first = run.state["phase2_first_shard"]

    def load(i):
        return src.read(i - first, ["h"])["h"] if src is not None else run.teacher.read(i, ["b0"])["b0"]

    def outputs():
        with torch.no_grad(), run.autocast():
            for h in track(prefetch(load, shards, depth=run.cfg.prefetch), f"propagating segment {seg.index}", total=len(shards)):
                yield {"h": _forward_segment(run, seg, _to(h, run)).to("cpu", dtype)}

    dst.write(outputs(), key=f"level{seg.index + 1}")
    if src is not None:
        src.clear()


def _phase2(run: Run, steps: int, shards: list[int]) -> None:
    """Network order; inputs go from teacher features to the trained student prefix's outputs."""
    for seg in run.segments:
        k = seg.index
        if k in run.state["phase2_done"]:
            _load_segment(run, seg, 2)
            continue
        if k > 0 and not _student_cache(run, k).is_complete(f"level{k}"):
            for prev in run.segments[:k]:  # resumed after an interrupted propagation: rebuild the inputs
                if not _student_cache(run, prev.index + 1).is_complete(f"level{prev.index + 1}"):
                    with run.materialized(prev):
                        _propagate(run, prev, shards)
        with run.materialized(seg):
            _train_segment(run, seg, phase=2, steps=steps, shards=shards)
            _save_segment(run, seg, 2, _segment_state(run, seg))
            run.state["phase2_done"].append(k)
            run.save_state()
            if run.streamed is not None:
                _load_segment(run, seg, 2)  # from now on the segment is read from its phase-2 file
            if k < len(run.segments) - 1:
                _propagate(run, seg, shards)
    for k in range(len(run.segments) + 1):
        _student_cache(run, k).clear()


def _e2e_from_cache(run: Run, steps: int) -> None:
    """End-to-end logit KL on the whole student, teacher logits from the cached final teacher states.

    At --e2e-lr (default a quarter of the layer-wise learning rate); checkpointed every quarter of the steps
    (work/e2e-steps-checkpoint.json), so `--resume` continues from the last quarter.
    """
    from llmcompress.distill.e2e import logit_steps
    from llmcompress.io.adapters import get_adapter

    cfg = run.cfg
    last = f"b{len(run.segments)}"
    logit_steps(
        run, run.model, get_adapter(run.model).decoder_layers(run.model), steps=steps, lr=cfg.e2e_steps_lr,
        order=cur.epoch_order(run.teacher.n_shards, steps, seed=cfg.seed + 7),
        load=lambda i: run.teacher.read(i, ["ids", last]),
        teacher_logits=lambda batch, ids: run.head(run.norm(_to(batch[last], run))),
        title="end-to-end steps", name="e2e-steps-checkpoint.json",
    )


# ------------------------------------------------------------------------------------------ runs


def _check_data_parallel(cfg: DistillConfig, dist: DistInfo) -> None:
    """Data-parallel e2e splits every batch evenly over the ranks."""
    if dist.active and (cfg.mode == Mode.E2E or cfg.e2e_steps > 0) and cfg.batch_size % dist.world_size:
        from llmcompress.errors import UserError

        raise UserError(f"--batch-size {cfg.batch_size} does not split evenly over {dist.world_size} ranks",
                        f"use a multiple of {dist.world_size} (each rank trains on its share of every batch)")


def _run_report(run: Run, metrics: dict) -> dict:
    """OUT/report.json: the figures a comparison of runs needs (gradient bytes, final training loss)."""
    import json

    recs = [json.loads(x) for x in (run.out / "train_log.jsonl").read_text().splitlines() if x.strip()] if (run.out / "train_log.jsonl").is_file() else []
    e2e = {r["step"]: r for r in recs if r.get("phase") == "e2e"}  # the last record of each step (a resumed run repeats none)
    losses_ = [e2e[k]["loss"] for k in sorted(e2e)]
    n = max(1, len(losses_) // 10)
    comm = metrics.get("grad_compress") or {}
    step_s = sum(r.get("step_s", 0.0) for r in e2e.values())
    monitor = sum(r.get("monitor_s", 0.0) for r in e2e.values())
    return {
        "mode": run.cfg.mode.value, "world_size": run.dist.world_size, "grad_compress": run.cfg.grad_compress.value,
        "comm_bytes": int(comm.get("comm_bytes", 0)), "comm_matrix_bytes": int(comm.get("comm_matrix_bytes", 0)),
        "final_train_loss": sum(losses_[-n:]) / n if losses_ else None, "train_steps": len(losses_),
        "final_grad_rank": comm.get("final_rank"), "grad_rank_changes": comm.get("rank_changes"),
        "monitor_share_of_step_time": (monitor / step_s) if step_s else None,
        WIKITEXT2_PPL: metrics.get(WIKITEXT2_PPL), "train_wall_s": metrics.get("train_wall_s"),
    }


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def distill(
    cfg: DistillConfig,
    out: Path,
    *,
    device: str = "cpu",
    overwrite: bool = False,
    resume: bool = False,
    dist: DistInfo | None = None,
    keep_work: bool = False,
    max_memory: int | None = None,
) -> DistillResult:
    """Distil a smaller student from `cfg.teacher` into `out` (see the module docstring).

    Args:
        cfg: the run's settings.
        out: output directory (student/, train_log.jsonl, report.md, metrics.json, work/).
        device: "cpu", "cuda" or "auto".
        overwrite: replace an existing `out`.
        resume: continue an interrupted run in `out` (same settings required).
        dist: this process's place in a torch.distributed group (None: single process).
        keep_work: keep `out/work` (segment weights, student features, resume state) after success;
            by default it is removed once the student and the report are written.
        max_memory: bytes the teacher may take (None: the memory available; 0: always stream). Above it, the
            layer-wise mode streams the teacher and the student layer by layer (distill/stream.py).
    """
    import torch

    from llmcompress.io.load import load_model
    from llmcompress.runtime import resolve_device, seed_everything

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dist = dist or DistInfo()
    if dist.world_size > 1 and cfg.act_grad == "factored":
        from llmcompress.errors import UserError

        raise UserError("--act-grad factored runs in a single process: under torchrun DDP all-reduces dense weight gradients",
                        "drop --act-grad factored (or torchrun)")
    out = Path(out)
    t_start = time.perf_counter()
    dev, _ = resolve_device(device)
    stream_path = _stream_path(cfg, dev, dist, max_memory)  # before --out is prepared
    state = prepare_out(cfg, out, overwrite, resume, dist)
    state = dist.broadcast(state)
    seed_everything(cfg.seed)
    runner = None
    if stream_path is None:
        lm = load_model(cfg.teacher, device=dev)
    else:
        from llmcompress.distill.cache import CACHE_MICRO_BATCH
        from llmcompress.io.stream import open_streamed

        lm, runner = open_streamed(cfg.teacher, stream_path, dtype=torch.float32, device=dev, batch=CACHE_MICRO_BATCH)
    blocks, data_label = load_blocks(lm.tokenizer, cfg, lm.model if runner is None else None)
    layer_map, keep = plan_student(cfg, lm.model, blocks, runner=runner)
    n_teacher = lm.model.config.num_hidden_layers
    segments = segment_layout(layer_map, n_teacher, cfg.segments)
    metrics: dict[str, Any] = {"mode": cfg.mode.value, "data": data_label, "train_tokens": cfg.train_tokens,
                               "unique_tokens": int(blocks.numel()), "teacher_layers": n_teacher,
                               "student_layers": len(layer_map), "segments": [s.to_dict() for s in segments],
                               "teacher_parameters": _n_params(lm.model), "streamed": runner is not None}
    if dist.is_main and cfg.eval_tokens > 0:
        metrics[TEACHER_PPL] = eval_ppl(lm.model, lm.tokenizer, cfg) if runner is None else ppl_streamed(runner, lm.tokenizer, cfg)
    t_train = time.perf_counter()
    run = Run(cfg, out, dist, dev, tokenizer=lm.tokenizer, segments=segments, state=state)
    run.work.mkdir(parents=True, exist_ok=True)
    _check_data_parallel(cfg, dist)
    if cfg.grad_compress.value != "none" and not dist.active:
        import logging

        logging.getLogger("llmcompress.distill").warning("--grad-compress %s has no effect in a single process (run under torchrun)",
                                                         cfg.grad_compress.value)
    if cfg.mode == Mode.E2E:  # under torchrun: data-parallel (every rank trains on its share of each batch)
        from llmcompress.distill.e2e import train_e2e

        student = train_e2e(run, lm.model, keep, blocks)
        metrics[BEFORE_PPL] = run.state.pop(BEFORE_PPL, None)
        metrics["eval_before_s"] = run.state.pop("eval_before_s", 0.0)
        lm.model = None
    else:
        student = _layerwise(run, lm, keep, blocks, metrics, runner=runner, stream_path=stream_path,
                             budget=max_memory or (available_memory(dev) if runner is not None else 0))
    metrics["train_wall_s"] = round(time.perf_counter() - t_train - metrics.get("eval_before_s", 0.0), 2)  # evaluation excluded
    metrics["peak_rss_mb"] = round(peak_rss_mb(), 1)
    if run.comm is not None:
        metrics["grad_compress"] = run.comm.summary()
        if dist.is_main and run.comm.psgd is not None and run.comm.psgd.adapt:
            from llmcompress.comm.edgc import plot_traces

            plot_traces(run.comm.psgd.rank_trace, run.comm.psgd.entropy_trace, out / "grad-compress.png",
                        title=f"EDGC: PowerSGD rank and gradient entropy ({dist.world_size} ranks)")
    if "activations" in run.state:  # saved-for-backward bytes and step time of the training loops (actcomp)
        metrics["activations"] = run.state.pop("activations")
    if not dist.is_main:
        return DistillResult(out, None, layer_map, segments, metrics)
    metrics["student_parameters"] = _n_params(student)
    if cfg.eval_tokens > 0:
        metrics[WIKITEXT2_PPL] = eval_ppl(student, run.tokenizer, cfg) if run.streamed is None else ppl_streamed(run.streamed, run.tokenizer, cfg)
    metrics["wall_s"] = round(time.perf_counter() - t_start, 2)
    student_dir = _save(run, student, lm, layer_map, metrics)
    import json

    from llmcompress.distill.report import write_report
    from llmcompress.io.checkpoint import MANIFEST

    saved = json.loads((student_dir / MANIFEST).read_text())
    metrics["student_bytes_on_disk"], metrics["student_dtype"] = saved.get("bytes_on_disk"), saved.get("dtype")
    write_json(out / "metrics.json", metrics)
    write_json(out / "report.json", _run_report(run, metrics))

    write_report(out, cfg, metrics)
    if not keep_work:  # only what --resume needed: the finished run does not (hundreds of MB on a real model)
        import shutil

        shutil.rmtree(run.work, ignore_errors=True)
    return DistillResult(out, student_dir, layer_map, segments, metrics)


def _stream_path(cfg: DistillConfig, dev, dist: DistInfo, max_memory: int | None) -> Path | None:
    """The teacher's safetensors directory when the run streams it (above the memory budget; rank 0 decides),
    else None. A run that needs the whole model is refused in one line when it cannot fit (or must stream)."""
    import torch

    from llmcompress.distill.stream import check_streamable, whole_model_needs
    from llmcompress.io.stream import check_fits, should_stream

    needs = whole_model_needs(cfg)
    if needs:
        if max_memory == 0:
            check_streamable(cfg, "--max-memory 0 streams the teacher layer by layer")
        check_fits(cfg.teacher, torch.float32, dev, what="distill (the teacher and its student)", budget=max_memory,
                   fix=f"drop {' and '.join(needs)} (the layer-wise mode streams layer by layer), or use a machine or GPU with more memory")
        return None
    path = should_stream(cfg.teacher, torch.float32, dev, max_memory, what="the layer-wise distillation") if dist.is_main else None
    path = dist.broadcast(path)
    if path is not None:
        from llmcompress.distill.stream import check_streamed_run

        check_streamed_run(cfg, path, max_memory if max_memory else available_memory(dev))
    return path


def _streamed_student(run: Run, runner, keep: list[int] | None):
    """The StudentRunner of a streamed run: the teacher runner cut to `keep`, or the --student checkpoint streamed."""
    import torch

    from llmcompress.distill.stream import StudentRunner
    from llmcompress.io.stream import streamable_dir

    if keep is not None:
        return StudentRunner.removal(runner, keep)
    student = StudentRunner.open(streamable_dir(run.cfg.student), dtype=torch.float32, device=run.device, batch=runner.batch)  # checked by _stream_path
    student.parent = runner
    return student


def _layerwise(run: Run, lm, keep: list[int] | None, blocks, metrics: dict, *, runner=None, stream_path=None, budget: int = 0):
    """Cache, free the teacher, phases 1 and 2, optional e2e steps; returns the trained student model.

    With a streamed teacher (`runner`, from `stream_path`; `budget`: the memory budget in bytes), the features are
    cached layer by layer and the student is a skeleton whose segments are loaded as they are used
    (distill/stream.py); the returned model is that skeleton."""

    from llmcompress.io.adapters import get_adapter
    from llmcompress.io.checkpoint import weights_hash
    from llmcompress.io.load import load_model
    from llmcompress.io.surgery import keep_layers
    from llmcompress.paths import cache_dir

    cfg = run.cfg
    boundaries = teacher_boundaries(run.segments)
    if runner is not None:
        from llmcompress.distill.stream import build_teacher_cache_streamed, files_key

        teacher_id = lm.source_hash or cache_key(*files_key(stream_path))
    else:
        teacher_id = lm.source_hash or weights_hash(lm.model)
    key_parts = [teacher_id, blocks, boundaries, cfg.cache_dtype.value, cfg.batch_size]
    if cfg.precision.value != "fp32":  # features computed at another precision are other features
        key_parts.append(cfg.precision.value)
    key = cache_key("distill-features-v1", *key_parts)
    root = Path(cfg.cache_dir) if cfg.cache_dir else cache_dir() / "distill-features"
    t0 = time.perf_counter()
    def build():
        if runner is not None:
            return build_teacher_cache_streamed(runner, blocks, boundaries, key=key, root=root / key, batch_size=cfg.batch_size,
                                                dtype=cfg.cache_dtype.value, precision=cfg.precision.value, budget=budget)
        return build_teacher_cache(lm.model, blocks, boundaries, key=key, root=root / key, batch_size=cfg.batch_size,
                                   dtype=cfg.cache_dtype.value, device=run.device, precision=cfg.precision.value)

    if run.dist.is_main:  # rank 0 first; the others then reuse its cache (shared filesystem) or build their own
        run.teacher = build()
    run.dist.barrier()
    if not run.dist.is_main:
        run.teacher = build()
    metrics["cache_s"] = round(time.perf_counter() - t0, 2)
    metrics["cache_dir"] = str(root / key)
    adapter = get_adapter(lm.model)
    if runner is not None:  # a skeleton; its layers are read from disk when a segment needs them
        from llmcompress.io.stream import compute_head

        run.streamed = _streamed_student(run, runner, keep)
        model = run.streamed.model
        teacher = run.streamed if keep is not None else runner  # whose norm and head give the KL targets
        run.norm, run.head = adapter.norm(teacher.model), compute_head(teacher)  # a bf16 checkpoint's head stays bf16
    elif keep is not None:  # the student is the teacher with layers cut out, in place: the rest is freed
        model = keep_layers(lm.model, keep)
        run.norm, run.head = adapter.norm(model), adapter.head(model)
    else:
        run.norm, run.head = copy.deepcopy(adapter.norm(lm.model)), copy.deepcopy(adapter.head(lm.model))
        lm.model = None
        gc.collect()
        model = load_model(cfg.student, device=run.device).model
    lm.model = None
    gc.collect()
    model.requires_grad_(False)
    run.norm.requires_grad_(False)
    run.head.requires_grad_(False)
    run.model = model
    if run.dist.is_main and cfg.eval_tokens > 0:
        t_eval = time.perf_counter()
        metrics[BEFORE_PPL] = eval_ppl(model, run.tokenizer, cfg) if run.streamed is None else ppl_streamed(run.streamed, run.tokenizer, cfg)
        metrics["eval_before_s"] = round(time.perf_counter() - t_eval, 2)
    n_shards = run.teacher.n_shards
    steps1, steps2 = cur.split_steps(cfg.train_tokens, cfg.batch_size * cfg.seq_len, cfg.phase1_fraction)
    split = min(max(1, round(n_shards * cfg.phase1_fraction)), n_shards)
    p1_shards = list(range(split)) if split > 0 else list(range(n_shards))
    p2_shards = list(range(split, n_shards)) or list(range(n_shards))
    run.state["phase2_first_shard"] = p2_shards[0]
    if "order" not in run.state:
        losses0 = _initial_losses(run, p1_shards[0])
        run.state["initial_losses"] = {str(k): v for k, v in losses0.items()}
        run.state["order"] = cur.difficulty_order(losses0)
        run.save_state()
    run.state = run.dist.broadcast(run.state)  # every rank splits the same order
    metrics.update(initial_losses=run.state["initial_losses"], order=run.state["order"], steps_phase1=steps1, steps_phase2=steps2)
    t1 = time.perf_counter()
    if steps1 > 0:
        _phase1(run, steps1, p1_shards)
    metrics["phase1_s"] = round(time.perf_counter() - t1, 2)
    data_parallel = run.dist.active and cfg.e2e_steps > 0
    if not run.dist.is_main and not data_parallel:
        return model
    t2 = time.perf_counter()
    if steps2 > 0 and run.dist.is_main:  # phase 2 is sequential (rank 0); with --e2e-steps the others wait for it
        _phase2(run, steps2, p2_shards)
    metrics["phase2_s"] = round(time.perf_counter() - t2, 2)
    if cfg.e2e_steps > 0:
        t3 = time.perf_counter()
        if run.dist.broadcast(not run.state.get("e2e_done") or not (run.work / "e2e.json").is_file()):  # data-parallel: DDP copies rank 0's student to all; a run saved before e2e.json redoes it
            _e2e_from_cache(run, cfg.e2e_steps)
            if run.dist.is_main:
                save_state(run.work / "e2e.json", {"model": model.state_dict()})
                run.state["e2e_done"] = True
                run.save_state()
        else:
            model.load_state_dict(load_state(run.work / "e2e.json")["model"])
        metrics["e2e_s"] = round(time.perf_counter() - t3, 2)
    return model


def _save(run: Run, student, lm, layer_map: list[dict], metrics: dict) -> Path:
    from llmcompress.io.checkpoint import build_manifest, save_checkpoint

    manifest = build_manifest(
        source=run.cfg.teacher, source_hash=lm.source_hash, method=f"distill-{run.cfg.mode.value}",
        config=run.cfg.to_dict(), metrics={k: v for k, v in metrics.items() if k not in ("segments",)},
        extra={"layer_map": layer_map, "segments": metrics["segments"]},
    )
    student.eval()
    from llmcompress.io.dtypes import save_dtype_for

    dtype = save_dtype_for(lm, run.cfg.save_dtype)
    if run.streamed is not None:  # one layer at a time, from the segment files
        from llmcompress.io.stream import write_streamed

        path = write_streamed(student, run.streamed, run.tokenizer, run.out / "student", manifest, compute_dtype=run.streamed.dtype,
                              dtype=dtype, overwrite=True)
    else:
        path = save_checkpoint(student, run.tokenizer, run.out / "student", manifest=manifest, overwrite=True, dtype=dtype)
    write_json(run.out / "metrics.json", metrics)
    return path
