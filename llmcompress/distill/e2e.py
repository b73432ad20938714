"""The baseline: conventional end-to-end logit distillation (teacher and student both in memory).

Same data, token budget, optimiser and trainable set (the student's decoder layers; embeddings, final
norm and head frozen and shared in value with the teacher) as the layer-wise run, so the two compare
side by side. KL(teacher || student) on every position's logits.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from llmcompress.distill import curriculum as cur
from llmcompress.distill import losses

if TYPE_CHECKING:
    from llmcompress.distill.run import Run


def build_student(run: Run, teacher, keep: list[int] | None):
    """A removal student (a copy of the teacher's `keep` layers, the others never copied) or the checkpoint in
    cfg.student."""
    from llmcompress.io.load import load_model
    from llmcompress.io.surgery import kept_copy

    if keep is not None:
        return kept_copy(teacher, keep)
    return load_model(run.cfg.student, device=run.device).model


def train_e2e(run: Run, teacher, keep: list[int] | None, blocks):
    """Train the student for ceil(train_tokens / tokens_per_step) steps of full-logit KL; returns it."""
    import torch

    from llmcompress.distill.run import BEFORE_PPL, eval_ppl

    cfg = run.cfg
    student = build_student(run, teacher, keep)
    student.requires_grad_(False)
    teacher.requires_grad_(False)
    if run.dist.is_main and cfg.eval_tokens > 0:
        t_eval = time.perf_counter()
        run.state[BEFORE_PPL] = eval_ppl(student, run.tokenizer, cfg)
        run.state["eval_before_s"] = round(time.perf_counter() - t_eval, 2)
    from llmcompress.io.adapters import get_adapter

    steps = max(1, math.ceil(cfg.train_tokens / (cfg.batch_size * cfg.seq_len)))
    order = cur.epoch_order(len(blocks) // cfg.batch_size, steps, seed=cfg.seed + 3)
    torch.manual_seed(cfg.seed)
    logit_steps(
        run, student, get_adapter(student).decoder_layers(student), steps=steps, lr=cfg.learning_rate, order=order,
        load=lambda j: {"ids": blocks[j * cfg.batch_size : (j + 1) * cfg.batch_size]},
        teacher_logits=lambda batch, ids: teacher(input_ids=ids, use_cache=False).logits,
        title="end-to-end distillation", name="e2e-checkpoint.json",
    )
    return student.eval()


def logit_steps(run: Run, model, layers, *, steps: int, lr: float, order: list, load, teacher_logits, title: str, name: str) -> None:
    """The end-to-end loop of `--mode e2e` and of the `--e2e-steps` phase: logit KL (+ CE) on `model`.

    Trains the parameters of `layers` with AdamW (cosine decay from `lr`) for `steps` steps; step s reads
    batch `load(order[s])` (a dict with "ids", prefetched) and gets the teacher's logits from
    `teacher_logits(batch, ids)` (no grad). The layers and optimiser state are checkpointed to
    work/`name` every quarter of the steps; a rerun continues from the last checkpoint.

    Under torchrun (world W > 1) the loop is data-parallel: `model` is wrapped in DDP (gloo on CPU, nccl on
    GPU; DDP copies rank 0's weights to every rank), each rank trains on rows [r B/W, (r+1) B/W) of every
    global batch of B blocks, and DDP averages the gradients through the `--grad-compress` hook
    (comm/edgc.py), so the update equals the single-process one on the whole batch up to floating-point
    order (for `none` and the lossless `zip`). The logged loss is the mean over ranks (the global batch's).
    """
    import torch

    from llmcompress.distill.cache import prefetch
    from llmcompress.progress import bar

    cfg = run.cfg
    params = [p for layer in layers for p in layer.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    from llmcompress.actcomp.layer import summary, training
    from llmcompress.actcomp.optim import stepper

    comp = _grad_compression(run, model)
    every = max(1, steps // 4)
    t0 = time.perf_counter()
    with bar(title, total=steps) as b, training(layers, cfg.act_rank, budget=cfg.act_budget, seed=cfg.seed + 11,
                                                  co_compress=cfg.act_grad == "factored") as ac:
        stepped = stepper(opt, ac)  # opt, or its FactoredStep (--act-grad factored)
        start = restore(run, layers, opt, steps, name=name, comp=comp, act=ac)
        ddp = _wrap(run, model, comp)
        fwd = ddp if ddp is not None else model
        b.advance(start)
        for step, batch in enumerate(prefetch(load, order[start:], depth=cfg.prefetch), start=start):
            t_step = time.perf_counter()
            batch = shard(batch, run.dist.rank, run.dist.world_size)
            ac.set_step(step)
            for g in opt.param_groups:
                g["lr"] = cur.lr_at(step, steps, lr)
            ids = batch["ids"].to(run.device)
            with torch.no_grad(), run.autocast():
                t_logits = teacher_logits(batch, ids)
            with run.autocast():
                s_logits = fwd(input_ids=ids, use_cache=False).logits
            loss, parts = losses.logit_objective(s_logits, t_logits, ids, cfg.kl_temperature, cfg.ce_weight)
            losses.optimizer_step(stepped, params, loss)
            rec = {"phase": "e2e", "step": step, "loss": loss.item(), **parts}
            if comp is not None:
                rec = {**rec, **_mean_over_ranks(rec, parts), **comp.end_step(), "step_s": round(time.perf_counter() - t_step, 4)}
            run.log(rec)
            b.advance(info=f"loss={rec['loss']:.4f}")
            del t_logits, s_logits, loss
            if (step + 1) % every == 0 and step + 1 < steps:
                checkpoint(run, layers, opt, step + 1, steps, name=name, comp=comp, act=ac)
        run.state["activations"] = summary(ac, steps - start, time.perf_counter() - t0, run.state.get("activations"))
    if ddp is not None:
        del ddp  # its hooks on the parameters go with it
    if comp is not None:
        run.comm = comp
    for p in params:
        p.requires_grad_(False)
        p.grad = None


def shard(batch: dict, rank: int, world: int) -> dict:
    """Rank `rank`'s rows of every tensor in `batch` (contiguous, equal shares of the global batch)."""
    if world <= 1:
        return batch
    out = {}
    for k, v in batch.items():
        n = v.shape[0] // world
        out[k] = v[rank * n : (rank + 1) * n]
    return out


def _mean_over_ranks(rec: dict, parts: dict) -> dict:
    """The loss (and its parts) averaged over ranks: the global batch's value, identical on every rank."""
    import torch
    import torch.distributed as dist

    keys = ["loss", *parts]
    t = torch.tensor([float(rec[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: float(v) / dist.get_world_size() for k, v in zip(keys, t)}


def _grad_compression(run: Run, model):
    """The `--grad-compress` scheme's hook state (None in a single process: nothing to exchange)."""
    if not run.dist.active:
        return None
    from llmcompress.comm.edgc import GradCompression

    cfg = run.cfg
    return GradCompression(cfg.grad_compress.value, model, rank=cfg.grad_rank, r_min=cfg.grad_rank_min, r_max=cfg.grad_rank_max,
                           start_iter=cfg.grad_warmup, entropy_span=cfg.grad_entropy_span, seed=cfg.seed)


def _wrap(run: Run, model, comp):
    if comp is None:
        return None
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device(run.device)
    ids = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, broadcast_buffers=False)  # copies rank 0's weights to every rank
    comp.register(ddp)
    return ddp


def _comm_path(run: Run, name: str, step: int):
    return run.work / f"{name}.comm-rank{run.dist.rank}-step{step}.json"


def checkpoint(run: Run, layers, opt, step: int, steps: int, name: str = "e2e-checkpoint.json", comp=None, act=None) -> None:
    """Student layers + optimiser state (+ the activation compressor's, `act`) after `step` steps, written to work/`name` (+ .safetensors; for --resume).

    Data-parallel: every rank first writes its gradient-compression state (its own error feedback, the rank
    schedule, byte totals) to work/`name`.comm-rank{r}-step{step}.json (+ .safetensors), then rank 0 writes the weights.
    """
    from llmcompress.io.rundir import save_state

    if comp is not None:
        save_state(_comm_path(run, name, step), {"step": step, "comm": comp.state_dict()})
        run.dist.barrier()
    if run.dist.is_main:
        extra = {"act": act.state_dict()} if act is not None and act.state_dict() else {}
        save_state(run.work / name, {"step": step, "steps": steps, "layers": layers.state_dict(), "opt": opt.state_dict(), **extra})
    if comp is not None:
        run.dist.barrier()
        keep = _comm_path(run, name, step)
        for old in run.work.glob(f"{name}.comm-rank{run.dist.rank}-step*"):
            if old.with_suffix(".json") != keep:
                old.unlink(missing_ok=True)


def restore(run: Run, layers, opt, steps: int, name: str = "e2e-checkpoint.json", comp=None, act=None) -> int:
    """Step to continue from (0 without a matching checkpoint in work/`name`)."""
    from llmcompress.io.rundir import load_state

    st = load_state(run.work / name)
    if st is None or st["steps"] != steps:
        return 0
    if comp is not None:
        cst = load_state(_comm_path(run, name, int(st["step"])))
        if cst is None:
            return 0
        comp.load_state_dict(cst["comm"])
    layers.load_state_dict(st["layers"])
    opt.load_state_dict(st["opt"])
    if act is not None and "act" in st:
        act.load_state_dict(st["act"])
    return int(st["step"])
