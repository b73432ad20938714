"""The baseline: conventional end-to-end logit distillation (teacher and student both in memory).

Same data, token budget, optimiser and trainable set (the student's decoder layers; embeddings, final
norm and head frozen and shared in value with the teacher) as the layer-wise run, so the two compare
side by side. KL(teacher || student) on every position's logits.
"""

from __future__ import annotations

import copy
import math
import time
from typing import TYPE_CHECKING

from llmcompress.distill import curriculum as cur
from llmcompress.distill import losses

if TYPE_CHECKING:
    from llmcompress.distill.engine import _Run


def build_student(run: _Run, teacher, keep: list[int] | None):
    """A removal student (a copy of the teacher with `keep` layers) or the checkpoint in cfg.student."""
    from llmcompress.io.load import load_model
    from llmcompress.io.surgery import keep_layers

    if keep is not None:
        return keep_layers(copy.deepcopy(teacher), keep)
    return load_model(run.cfg.student, device=run.device).model


def train_e2e(run: _Run, teacher, keep: list[int] | None, blocks):
    """Train the student for ceil(train_tokens / tokens_per_step) steps of full-logit KL; returns it."""
    import torch

    from llmcompress.distill.engine import _eval_ppl

    cfg = run.cfg
    student = build_student(run, teacher, keep)
    student.requires_grad_(False)
    teacher.requires_grad_(False)
    if run.dist.is_main and cfg.eval_tokens > 0:
        t_eval = time.perf_counter()
        run.state["student_ppl_before"] = _eval_ppl(student, run.tokenizer, cfg)
        run.state["eval_before_s"] = round(time.perf_counter() - t_eval, 2)
    from llmcompress.io.adapters import get_adapter

    steps = max(1, math.ceil(cfg.train_tokens / (cfg.batch_size * cfg.seq_len)))
    order = cur.epoch_order(len(blocks) // cfg.batch_size, steps, seed=cfg.seed + 3)
    torch.manual_seed(cfg.seed)
    logit_steps(
        run, student, get_adapter(student).decoder_layers(student), steps=steps, lr=cfg.learning_rate, order=order,
        load=lambda j: {"ids": blocks[j * cfg.batch_size : (j + 1) * cfg.batch_size]},
        teacher_logits=lambda batch, ids: teacher(input_ids=ids, use_cache=False).logits,
        title="end-to-end distillation", name="e2e-checkpoint.pt",
    )
    return student.eval()


def logit_steps(run: _Run, model, layers, *, steps: int, lr: float, order: list, load, teacher_logits, title: str, name: str) -> None:
    """The end-to-end loop of `--mode e2e` and of the `--e2e-steps` phase: logit KL (+ CE) on `model`.

    Trains the parameters of `layers` with AdamW (cosine decay from `lr`) for `steps` steps; step s reads
    batch `load(order[s])` (a dict with "ids", prefetched) and gets the teacher's logits from
    `teacher_logits(batch, ids)` (no grad). The layers and optimiser state are checkpointed to
    work/`name` every quarter of the steps; a rerun continues from the last checkpoint.
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

    every = max(1, steps // 4)
    t0 = time.perf_counter()
    with bar(title, total=steps) as b, training(layers, cfg.act_rank, budget=cfg.act_budget, seed=cfg.seed + 11) as ac:
        start = restore(run, layers, opt, steps, name=name, act=ac)
        b.advance(start)
        for step, batch in enumerate(prefetch(load, order[start:], depth=cfg.prefetch), start=start):
            ac.set_step(step)
            for g in opt.param_groups:
                g["lr"] = cur.lr_at(step, steps, lr)
            ids = batch["ids"].to(run.device)
            with torch.no_grad(), run.autocast():
                t_logits = teacher_logits(batch, ids)
            with run.autocast():
                s_logits = model(input_ids=ids, use_cache=False).logits
            loss, parts = losses.logit_objective(s_logits, t_logits, ids, cfg.kl_temperature, cfg.ce_weight)
            losses.optimizer_step(opt, params, loss)
            run.log({"phase": "e2e", "step": step, "loss": loss.item(), **parts})
            b.advance(info=f"loss={loss.item():.4f}")
            del t_logits, s_logits, loss
            if (step + 1) % every == 0 and step + 1 < steps:
                checkpoint(run, layers, opt, step + 1, steps, name=name, act=ac)
        run.state["activations"] = summary(ac, steps - start, time.perf_counter() - t0, run.state.get("activations"))
    for p in params:
        p.requires_grad_(False)
        p.grad = None


def checkpoint(run: _Run, layers, opt, step: int, steps: int, name: str = "e2e-checkpoint.pt", act=None) -> None:
    """Student layers + optimiser state (+ the activation compressor's, `act`) after `step` steps, written
    atomically to work/`name` (for --resume)."""
    import torch

    from llmcompress.io.atomic import atomic_path

    extra = {"act": act.state_dict()} if act is not None and act.state_dict() else {}
    with atomic_path(run.work / name) as tmp:
        torch.save({"step": step, "steps": steps, "layers": layers.state_dict(), "opt": opt.state_dict(), **extra}, tmp)


def restore(run: _Run, layers, opt, steps: int, name: str = "e2e-checkpoint.pt", act=None) -> int:
    """Step to continue from (0 without a matching checkpoint in work/`name`)."""
    import torch

    path = run.work / name
    if not path.is_file():
        return 0
    st = torch.load(path, weights_only=True)
    if st["steps"] != steps:
        return 0
    layers.load_state_dict(st["layers"])
    opt.load_state_dict(st["opt"])
    if act is not None and "act" in st:
        act.load_state_dict(st["act"])
    return int(st["step"])
