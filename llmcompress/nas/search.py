"""The differentiable search loop (with atomic checkpoints for --resume) and the three modes.

loss = KL(teacher || student) over next-token distributions [+ hidden_mse * MSE of final hidden states]
       + lam * sum_t max(0, E[cost_t] / target_t - 1)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llmcompress.io.atomic import append_jsonl
from llmcompress.io.rundir import save_state
from llmcompress.metrics import token_kl
from llmcompress.nas.config import NasConfig
from llmcompress.nas.cost import CostModels
from llmcompress.nas.space import Arch, SearchSpace, argmax_arch, repair, upgrade
from llmcompress.nas.supernet import Supernet


@dataclass
class SearchResult:
    mode: str
    arch: Arch
    metrics: dict[str, float]
    logits: dict[str, torch.Tensor] | None = None
    note: str = ""
    refine: dict | None = None


def tau_at(cfg: NasConfig, step: int, steps: int) -> float:
    """Exponential annealing from tau_start to tau_end."""
    frac = step / max(steps - 1, 1)
    return cfg.tau_start * (cfg.tau_end / cfg.tau_start) ** frac


def state_path(out: Path, stage: str) -> Path:
    """Where a search stage keeps its resumable state: `search_state_<stage>.json` (+ `.safetensors`, io/rundir.py)."""
    return Path(out) / f"search_state_{stage}.json"


def load_stage_state(out: Path, stage: str) -> dict | None:
    """The saved state of `stage` (None when there is none). A `.pt` state of an older llmcompress (a pickle)
    or a damaged one: UserError (exit 2), start afresh with --overwrite."""
    from llmcompress.errors import UserError
    from llmcompress.io.rundir import load_state

    path = state_path(out, stage)
    legacy = path.with_suffix(".pt")
    if not path.is_file() and legacy.is_file():
        raise UserError(f"{legacy} is a search state of an older llmcompress (a pickle), which is no longer read",
                        "start the search afresh with --overwrite")
    try:
        st = load_state(path)
        if st is not None and (not isinstance(st, dict) or "fingerprint" not in st):
            raise ValueError("not a search state")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read the search state {path}: {str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}",
                        "start afresh with --overwrite") from None
    return st


def distill_loss(t_out, s_out, hidden_mse: float) -> torch.Tensor:
    t_logp = F.log_softmax(t_out.logits.float(), -1)
    s_logp = F.log_softmax(s_out.logits.float(), -1)
    loss = token_kl(t_logp, s_logp).mean()
    if hidden_mse > 0:
        th, sh = t_out.hidden_states[-1], s_out.hidden_states[-1]
        loss = loss + hidden_mse * (sh - th).pow(2).mean() / th.pow(2).mean().clamp(min=1e-8)
    return loss


def run_stage(
    model, net: Supernet, costs: CostModels, cfg: NasConfig, blocks: torch.Tensor, out: Path, stage: str, resume: bool
) -> dict[str, torch.Tensor]:
    """Train the supernet's learnable logits for cfg.steps steps; returns the final logits."""
    from llmcompress.progress import bar

    steps, targets = cfg.grad_steps, cfg.targets()
    if steps == 0:  # no gradient phase: the initial (proxy) logits are the result
        return net.logits()
    opt = torch.optim.Adam(net.trainable(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed + 17)
    log_path = out / "search_log.jsonl"
    start = 0
    st = load_stage_state(out, stage) if resume else None
    if st is not None:
        from llmcompress.errors import UserError

        if st["fingerprint"] != cfg.fingerprint():
            raise UserError(f"{out} holds a search with different settings", "use the same settings, or a new --out")
        net.load_state_dict(st["net"], strict=False)
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        start = st["step"]
    order = torch.randperm(steps * cfg.batch_size, generator=torch.Generator().manual_seed(cfg.seed)) % len(blocks)
    for p in model.parameters():
        p.requires_grad_(False)
    net.install()
    from llmcompress.actcomp.layer import training

    try:
        with bar(f"search ({stage})", total=steps) as b, training(model, cfg.act_rank, budget=cfg.act_budget, seed=cfg.seed + 31) as ac:
            if start and "act" in st:
                ac.load_state_dict(st["act"])
            b.update(completed=start)
            for step in range(start, steps):
                ac.set_step(step)
                tau = tau_at(cfg, step, steps)
                batch = blocks[order[step * cfg.batch_size : (step + 1) * cfg.batch_size]]
                with torch.no_grad():
                    t_out = model(input_ids=batch, use_cache=False, output_hidden_states=cfg.hidden_mse > 0)
                net.sample(tau, gen)
                with net.student():
                    s_out = model(input_ids=batch, use_cache=False, output_hidden_states=cfg.hidden_mse > 0)
                kl = distill_loss(t_out, s_out, cfg.hidden_mse)
                exp = expected_costs(net, costs)
                pen = sum(torch.relu(exp[k] / t - 1.0) for k, t in targets.items())
                loss = kl + cfg.lam * pen
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec = {"stage": stage, "step": step + 1, "tau": round(tau, 4), "kl": float(kl.detach()), "penalty": float(pen.detach() if torch.is_tensor(pen) else pen),
                       **{f"exp_{k}": float(v.detach()) for k, v in exp.items()}}
                append_jsonl(log_path, rec)
                b.advance(info=f"kl={rec['kl']:.3f} lat={rec['exp_latency']:.2f} bits={rec['exp_bits']:.2f}")
                if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == steps:
                    save_state(state_path(out, stage), {"net": net.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                                             "step": step + 1, "fingerprint": cfg.fingerprint(), "act": ac.state_dict()})
    finally:
        net.remove()
    return net.logits()


def expected_costs(net: Supernet, costs: CostModels) -> dict[str, torch.Tensor]:
    p = net.probs()
    p_keep = p["keep"][:, 1] if net.space.allow_skip else torch.ones(net.space.n_layers)
    return costs.expected(p_keep, p["width"], p["bits"])


def _finish(mode, space, costs, cfg, logits, arch=None) -> SearchResult:
    arch = arch or argmax_arch(space, logits)
    arch = repair(space, arch, logits, costs, cfg.targets())
    arch = upgrade(space, arch, logits, costs, cfg.targets())
    return SearchResult(mode, arch, costs.metrics(arch), logits)


def initial_logits(model, net: Supernet, cfg: NasConfig, blocks: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Sensitivity-proxy logits (see nas/sensitivity.py), or None when cfg.init is "uniform"."""
    if cfg.init_kappa <= 0:
        return None
    key = (id(model), id(net.bank), cfg.fingerprint())
    if key in _INIT_MEMO:  # joint and sequential in one run share it
        return {k: v.clone() for k, v in _INIT_MEMO[key].items()}
    from llmcompress.nas import sensitivity

    calib = blocks[: cfg.sensitivity_blocks]
    sens = sensitivity.measure(model, net.space, calib, net.bank)
    sens = sensitivity.calibrate(model, net.space, calib[: max(1, cfg.sensitivity_blocks // 4)], sens, net.bank)
    _INIT_MEMO.clear()
    _INIT_MEMO[key] = sensitivity.init_logits(sens, kappa=cfg.init_kappa)
    return {k: v.clone() for k, v in _INIT_MEMO[key].items()}


_INIT_MEMO: dict = {}


def _refined(model, net, res: SearchResult, costs, cfg, held_out, out: Path, starts: dict, kinds: set[str],
             resume: bool = False) -> SearchResult:
    """The validated last step (nas/refine.py): best start by measured KL on `held_out`, then mutations.
    Its result is saved atomically to `refine_<mode>.json`; a resumed run reuses it."""
    if held_out is None or (cfg.refine_evals <= 0 and len(starts) == 1):  # nothing to choose or try
        return res
    from llmcompress.io.atomic import write_json
    from llmcompress.nas.refine import refine

    path = out / f"refine_{res.mode}.json"
    if resume and path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("fingerprint") == cfg.fingerprint():
            arch = Arch(saved["keep"], saved["width"], saved["bits"])
            return SearchResult(res.mode, arch, costs.metrics(arch), res.logits, res.note, saved["summary"])

    def log(rec):
        append_jsonl(out / "search_log.jsonl", {"mode": res.mode, **rec})

    r = refine(model, net, net.space, costs, cfg.targets(), starts, held_out, evals=cfg.refine_evals,
               seed=cfg.seed + 29, kinds=kinds, logits=res.logits, log=log)
    write_json(path, {"fingerprint": cfg.fingerprint(), "keep": r.arch.keep, "width": r.arch.width, "bits": r.arch.bits,
                      "summary": r.summary()})
    return SearchResult(res.mode, r.arch, costs.metrics(r.arch), res.logits, res.note, r.summary())


def bank_for(model, space: SearchSpace, cfg: NasConfig, blocks: torch.Tensor):
    """The quantized weights every step of the run uses and the export ships (nas/qbank.py)."""
    from llmcompress.nas.qbank import build_bank

    return build_bank(model, space, cfg.quant_method, blocks[: cfg.gptq_blocks], cfg.gptq_act_order, sym8="gguf" in cfg.export)


def search_joint(model, space, costs, cfg, blocks, out, resume, held_out=None, bank=None) -> SearchResult:
    net = Supernet(model, space, bank if bank is not None else bank_for(model, space, cfg, blocks))
    init = initial_logits(model, net, cfg, blocks)
    if init is not None:
        net.init_from(init)
    logits = run_stage(model, net, costs, cfg, blocks, out, "joint", resume)
    res = _finish("joint", space, costs, cfg, logits)
    starts = {"searched": res.arch, "uniform": search_uniform(space, costs, cfg).arch}
    return _refined(model, net, res, costs, cfg, held_out, out, starts, {"bits", "width", "skip"}, resume)


def search_sequential(model, space, costs, cfg, blocks, out, resume, held_out=None, bank=None) -> SearchResult:
    """NAS in full precision (bits pinned to the widest), then bits searched on the fixed architecture,
    each stage with half the steps (equal total compute to joint)."""
    import dataclasses

    half = dataclasses.replace(cfg, train_tokens=max(cfg.train_tokens // 2, cfg.seq_len * cfg.batch_size),
                               search_steps=None if cfg.search_steps is None else cfg.search_steps // 2)
    net = Supernet(model, space, bank if bank is not None else bank_for(model, space, cfg, blocks))
    init = initial_logits(model, net, cfg, blocks)
    if init is not None:
        net.init_from(init, {"keep", "width"})
    net.fix(Arch.dense(space), {"bits"})
    arch_targets = {k: v for k, v in cfg.targets().items() if k != "bits"}
    stage1_cfg = dataclasses.replace(half, target_bits=None) if arch_targets else half
    if not arch_targets:  # only a bits target: the full-precision architecture search has no budget
        logits1 = net.logits()
    else:
        logits1 = run_stage(model, net, costs, stage1_cfg, blocks, out, "sequential-arch", resume)
    arch = argmax_arch(space, logits1)
    # stage 1 alone must meet the latency/size targets at full precision when it can
    arch = _repair_or_keep(space, arch, logits1, costs, arch_targets)
    net.fix(arch, {"keep", "width"})
    net.learn = {"bits"}
    with torch.no_grad():
        net.bits.copy_(init["bits"]) if init is not None else net.bits.zero_()
    logits2 = run_stage(model, net, costs, half, blocks, out, "sequential-bits", resume)
    arch.bits = argmax_arch(space, logits2).bits
    res = _finish("sequential", space, costs, cfg, logits2, arch)
    # the same validated refinement, on the bits only: the architecture was fixed at full precision
    return _refined(model, net, res, costs, cfg, held_out, out, {"searched": res.arch}, {"bits"}, resume)


def _repair_or_keep(space, arch, logits, costs, targets):
    from llmcompress.errors import UserError

    try:
        return repair(space, arch, logits, costs, targets)
    except UserError:
        return arch  # unreachable at full precision: bits must help in stage 2


def search_uniform(space: SearchSpace, costs: CostModels, cfg: NasConfig) -> SearchResult:
    """Dense architecture, one bit width everywhere: the widest that meets the size/bits targets."""
    targets = {k: v for k, v in cfg.targets().items() if not (k == "latency" and costs.kind == "lut")}
    for bi in reversed(range(len(space.bits))):
        arch = Arch.dense(space, bi)
        m = costs.metrics(arch)
        if all(m[k] <= t + 1e-9 for k, t in targets.items()):
            break
    note = ""
    if "latency" in cfg.targets() and m["latency"] > cfg.targets()["latency"] + 1e-9:
        note = f"the dense architecture cannot reach latency {cfg.targets()['latency']} ({m['latency']:.3f})"
    return SearchResult("uniform", arch, m, None, note)


def check_reachable(costs: CostModels, cfg: NasConfig) -> None:
    """UserError naming the first target below what the space can reach."""
    from llmcompress.errors import UserError

    low = costs.minimum()
    names = {"latency": "--target-latency", "size_mb": "--target-size-mb", "bits": "--target-bits"}
    for k, t in cfg.targets().items():
        if t < low[k] - 1e-9:
            raise UserError(
                f"{names[k]} {t} is below what the search space reaches (minimum {low[k]:.4g})",
                f"use {names[k]} {math.ceil(low[k] * 1000) / 1000} or more",
            )


def logits_to_json(logits) -> dict:
    return {k: v.tolist() for k, v in logits.items()} if logits else {}


def dump(obj) -> str:
    return json.dumps(obj)
