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
from llmcompress.nas.refine import QUANT_KINDS
from llmcompress.nas.space import Arch, SearchSpace, argmax_arch, repair, upgrade, violation
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
    return costs.expected(p_keep, p["width"], p["bits"], p.get("head"))


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
    sens = sensitivity.calibrate(model, net.space, calib[: max(1, cfg.sensitivity_blocks // 4)], sens, net.bank,
                                 bits_init=cfg.bits_init)
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
            arch = Arch(saved["keep"], saved["width"], saved["bits"], saved.get("head"))
            return SearchResult(res.mode, arch, costs.metrics(arch), res.logits, res.note, saved["summary"])

    def log(rec):
        append_jsonl(out / "search_log.jsonl", {"mode": res.mode, **rec})

    r = refine(model, net, net.space, costs, cfg.targets(), starts, held_out, evals=cfg.refine_evals,
               seed=cfg.seed + 29, kinds=kinds, logits=res.logits, log=log)
    write_json(path, {"fingerprint": cfg.fingerprint(), "keep": r.arch.keep, "width": r.arch.width, "bits": r.arch.bits, "head": r.arch.head,
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
    return _refined(model, net, res, costs, cfg, held_out, out, starts, {"bits", "width", "skip", "head"}, resume)


def search_sequential(model, space, costs, cfg, blocks, out, resume, held_out=None, bank=None) -> SearchResult:
    """NAS-then-quantize, as a sensible pipeline would run it: stage 1 searches the architecture (skips, MLP
    widths) with the bits pinned, stage 2 searches the bits on that fixed architecture under the final
    targets (bits moves only), each with half the gradient steps. Stage 1 is run several ways, and the
    validated step (held-out KL, nas/refine.py) keeps the best plan, the uniform plan included:

    * oracle split ("fp@r"): stage 1 at full precision with its latency/size target at `r` of dense, for
      each r of `cfg.sequential_splits` (1.0 down; a split stage 1 cannot reach ends the sweep, one that
      stage 2 cannot bring to the final targets is skipped);
    * quantization-aware ("q<b>", `cfg.sequential_quant_aware`): stage 1 costed at b bits everywhere under the
      final latency/size targets, for each bit width b below 16 (and within a bits target) from the widest
      at which the dense model already fits upwards (the levels at which the architecture must give way).

    With no latency or size target the architecture has no budget (average bits are a ratio over the kept
    weights, so pruning frees none): the only stage 1 is the dense model and sequential is the
    mixed-precision-only search (said in the result's note). Compute: each candidate costs one stage 1 +
    one stage 2 (half steps each), so the oracle spends up to (splits + levels) times joint's steps.
    """
    import dataclasses

    from llmcompress.errors import UserError

    half = dataclasses.replace(cfg, train_tokens=max(cfg.train_tokens // 2, cfg.seq_len * cfg.batch_size),
                               search_steps=None if cfg.search_steps is None else cfg.search_steps // 2)
    net = Supernet(model, space, bank if bank is not None else bank_for(model, space, cfg, blocks))
    init = initial_logits(model, net, cfg, blocks)
    init = init if init is not None else net.logits()  # kappa 0: the supernet's own starting logits
    targets = cfg.targets()
    arch_targets = {k: v for k, v in targets.items() if k != "bits"}
    top = len(space.bits) - 1
    candidates: list[tuple[str, int, dict[str, float]]] = []  # (name, pinned bits index, stage-1 targets)
    note = ""
    if not arch_targets:
        candidates.append(("mixed-precision-only", top, {}))
        note = ("only an average-bits target: the architecture stage has no budget (pruning frees none), "
                "so sequential is the mixed-precision-only search")
    else:
        dense_size = costs.metrics(Arch.dense(space))["size_mb"]
        for r in sorted(set(cfg.sequential_splits), reverse=True):
            t1 = {k: (r if k == "latency" else r * dense_size) for k in arch_targets}
            candidates.append((f"fp@{r:g}", top, t1))
        if cfg.sequential_quant_aware:
            levels = [k for k, b in enumerate(space.bits) if b < 16 and ("bits" not in targets or b <= targets["bits"] + 1e-9)]
            fits = [k for k in levels if violation(costs.metrics(Arch.dense(space, k)), arch_targets) <= 1e-9]
            lo = max(fits) if fits else (min(levels) if levels else None)
            candidates += [(f"q{space.bits[k]}", k, dict(arch_targets)) for k in levels if lo is not None and k >= lo]
    starts: dict[str, Arch] = {}
    failed_split = False
    for name, pin, t1 in candidates:
        if failed_split and name.startswith("fp@"):
            continue
        try:
            arch1 = _sequential_stage1(model, net, space, costs, half, blocks, out, resume, init, name, pin, t1)
        except UserError:  # stage 1 cannot reach t1 with this pinning (lower splits cannot either)
            failed_split = failed_split or name.startswith("fp@")
            continue
        try:
            starts[name] = _sequential_stage2(model, net, space, costs, half, cfg, blocks, out, resume, init, name, arch1)
        except UserError:  # bits alone cannot bring this architecture to the final targets
            continue
    if not starts:
        raise UserError(f"sequential: no stage-1 architecture can be brought to the targets {targets} by bits alone",
                        "relax a target, or add splits to sequential_splits")
    first = next(iter(starts))
    res = SearchResult("sequential", starts[first], costs.metrics(starts[first]), net.logits(), note)
    uni = search_uniform(space, costs, cfg).arch  # dense + one width: a plan NAS-then-quantize can end at too
    starts = {**starts, "uniform": uni}
    # the validated step: the best of every stage-1 variant (the oracle) and uniform, then bits mutations
    return _refined(model, net, res, costs, cfg, held_out, out, starts, QUANT_KINDS, resume)


def _sequential_stage1(model, net, space, costs, half, blocks, out, resume, init, name, pin, t1) -> Arch:
    """Skips and widths searched with every linear pinned at bits index `pin` under `t1` (latency/size)."""
    import dataclasses

    net.learn = {"keep", "width", "bits"}
    net.init_from(init, {"keep", "width"})
    net.fix(Arch.dense(space, pin), {"bits", "head"})  # the head (a quantization choice) is stage 2's
    if not t1:  # nothing to meet: the dense architecture
        return Arch.dense(space, pin)
    cfg1 = dataclasses.replace(half, target_latency=t1.get("latency"), target_size_mb=t1.get("size_mb"), target_bits=None)
    logits1 = run_stage(model, net, costs, cfg1, blocks, out, f"sequential-arch-{name}", resume)
    arch = argmax_arch(space, logits1)
    arch.bits, arch.head = Arch.dense(space, pin).bits, Arch.dense(space).head
    arch = repair(space, arch, logits1, costs, t1, {"skip", "width"})
    return upgrade(space, arch, logits1, costs, t1, {"skip", "width"})


def _sequential_stage2(model, net, space, costs, half, cfg, blocks, out, resume, init, name, arch1) -> Arch:
    """Bits (and the head's, when searched) on the fixed architecture `arch1` under the final targets
    (quantization moves only)."""
    net.fix(arch1, {"keep", "width"})
    net.learn = QUANT_KINDS & set(net.groups)
    net.init_from(init, QUANT_KINDS & set(net.groups))
    logits2 = run_stage(model, net, costs, half, blocks, out, f"sequential-bits-{name}", resume)
    arch = arch1.copy()
    derived = argmax_arch(space, logits2)
    arch.bits, arch.head = derived.bits, derived.head
    arch = repair(space, arch, logits2, costs, cfg.targets(), QUANT_KINDS)
    return upgrade(space, arch, logits2, costs, cfg.targets(), QUANT_KINDS)


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
