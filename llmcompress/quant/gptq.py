"""GPTQ (Frantar et al., 2023): round-to-nearest column by column, compensating each column's rounding
error on the columns not yet quantized, weighted by the inverse Hessian H = E[x x^T] of the layer input.

Output uses the same conventions as `primitives` (group-wise asymmetric scales/zeros, float16 scales), so a
GPTQ weight packs, reloads and dequantizes exactly like an RTN one. Group parameters are chosen when the
group's first column is reached, from the already-compensated weights (GPTQ's default, non-static groups).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmcompress.quant import primitives as P

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from llmcompress.quant.apply import QuantizedWeight
    from llmcompress.quant.plan import MixedPrecisionPlan


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, *, damp: float = 0.01, block: int = 128,
                  act_order: bool = False, sym: bool = False):
    """Quantize W (out, in) against Hessian H (in, in). Returns (q int32, scale (out, G), zero (out, G)).

    act_order: quantize the columns in order of decreasing Hessian diagonal (the inputs with the most energy
    first, while the most columns remain to absorb their error), with *static* groups: each group's
    scale/zero come from the original weights before any compensation, so the storage layout (group g =
    columns g*group_size..) is unchanged.
    """
    import torch

    P.check_bits(bits)
    out, inp = W.shape
    if inp % group_size:
        raise ValueError(f"group size {group_size} does not divide the input width {inp}")
    block = max(group_size, (block // group_size) * group_size)
    W = W.detach().float().clone()
    # float32 throughout, as the reference implementation (IST-DASLab/gptq) and llm-compressor: a float64
    # copy of a 5632-wide Hessian and its factors are 254 MB each
    H = H.detach().to(device=W.device, dtype=torch.float32, copy=True)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(damp * torch.diag(H).mean())  # + damp * mean(diag) * I, without an (in, in) identity
    if act_order:
        static = P.quant_params(W, bits, group_size, sym)  # static groups, from the uncompensated weights
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm[:, None], perm]
    else:
        perm = torch.arange(inp, device=W.device)
    try:  # step by step, freeing each (in, in) matrix once used
        Hinv = torch.linalg.cholesky(H)
        del H
        Hinv = torch.cholesky_inverse(Hinv)
        Hinv = torch.linalg.cholesky(Hinv, upper=True)
    except RuntimeError:  # not positive definite even after damping: fall back to RTN
        return P.quantize(W[:, torch.argsort(perm)], bits, group_size, sym=sym)
    qmax = 2**bits - 1
    G = inp // group_size
    dev = W.device
    scale, zero = static if act_order else (torch.zeros(out, G, device=dev), torch.zeros(out, G, dtype=torch.int32, device=dev))
    Q = torch.zeros(out, inp, dtype=torch.int32, device=dev)
    for i1 in range(0, inp, block):
        i2 = min(i1 + block, inp)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // group_size
            if not act_order and col % group_size == 0:
                s, z = P.quant_params(W1[:, i : i + group_size], bits, group_size, sym)
                scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
            w = W1[:, i]
            q = (torch.round(w / scale[:, g]) + zero[:, g]).clamp(0, qmax)
            Q[:, col] = q.to(torch.int32)
            err = (w - (q - zero[:, g]) * scale[:, g]) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    return Q, scale, zero


def input_hessians(model: nn.Module, fqns: list[str], blocks: torch.Tensor, batch: int = 2) -> dict[str, torch.Tensor]:
    """E[x x^T] of each named linear's input over `blocks` (one pass; modules sharing an input share it)."""

    modules = dict(model.named_modules())
    H: dict[str, torch.Tensor] = {}
    hooks = []
    for name in fqns:
        def pre(mod, args, name=name):
            _add_outer(H, name, args[0])
        hooks.append(modules[name].register_forward_pre_hook(pre))
    from llmcompress.io.forward import forward_with_hooks

    n = max(forward_with_hooks(model, blocks, hooks, batch), 1)
    return {k: v.div_(n) for k, v in H.items()}


def _add_outer(sums: dict, name: str, x: torch.Tensor) -> None:
    """sums[name] += x^T x over the rows of x (..., d), in place: no (d, d) temporary per batch."""
    x2 = x.detach().float().reshape(-1, x.shape[-1])
    acc = sums.get(name)
    if acc is None:
        sums[name] = x2.T @ x2
    else:
        acc.addmm_(x2.T, x2)


def layer_hessians(runner, i: int, layer: nn.Module, fqns: list[str], hidden: list[torch.Tensor]):
    """Run decoder layer i over the per-batch states `hidden`, accumulating E[x x^T] of the inputs of the
    linears `fqns` (model FQNs inside this layer). Linears fed the same tensor (q/k/v, gate/up) share one
    Hessian. Returns (outputs, {fqn: H}); the sums run in the order `input_hessians` runs them, so the
    matrices are the same."""
    prefix = runner.layer_prefix(i)
    mods = {fqn: layer.get_submodule(fqn[len(prefix):]) for fqn in fqns}
    sums: dict[str, torch.Tensor] = {}
    owner: dict[str, str] = {}
    seen: dict[int, tuple] = {}  # id -> (tensor, first fqn); the tensor is held so that its id is not reused
    hooks = []
    for name, mod in mods.items():
        def pre(m, args, name=name):
            x = args[0]
            first = seen.setdefault(id(x), (x, name))[1]
            owner[name] = first
            if first == name:
                _add_outer(sums, name, x)
        hooks.append(mod.register_forward_pre_hook(pre))
    outs, n = [], 0
    try:
        for h in hidden:
            seen.clear()
            outs.append(runner.run(i, layer, h))
            n += h.shape[0] * h.shape[1]
    finally:
        for hk in hooks:
            hk.remove()
    n = max(n, 1)
    means = {first: h.div_(n) for first, h in sums.items()}
    return outs, {name: means[owner[name]] for name in mods if name in owner}  # shared inputs: one tensor


INPUTS = ("dense", "quantized")


def assign_linears(shapes: dict[str, tuple[int, int]], world_size: int) -> list[list[str]]:
    """The linears (FQN -> weight shape (out, in)) each of `world_size` ranks quantizes: longest job first,
    each to the least loaded rank, by GPTQ's cost (the Cholesky, in^3, plus the column sweep, out * in^2).
    Deterministic (ties go to the lower rank, then the planned order), so every rank computes the same split."""
    load = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    order = sorted(shapes, key=lambda f: -(shapes[f][1] ** 3 + shapes[f][0] * shapes[f][1] ** 2))  # stable: ties keep order
    for fqn in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        out[r].append(fqn)
        load[r] += shapes[fqn][1] ** 3 + shapes[fqn][0] * shapes[fqn][1] ** 2
    return out


def _exchange(got: dict, info) -> dict:
    """Every rank's integers of this layer on every rank (torch.distributed all-gather of Python objects)."""
    import torch.distributed as dist

    parts: list = [None] * info.world_size
    dist.all_gather_object(parts, got)
    return {fqn: qw for part in parts for fqn, qw in part.items()}


def gptq_layerwise_(runner, plan: MixedPrecisionPlan, blocks: torch.Tensor, *, act_order: bool = False, inputs: str = "dense",
                    sink=None, progress: bool = True) -> dict[str, QuantizedWeight]:
    """GPTQ one decoder layer at a time over a `io.stream.LayerRunner` (in memory or streamed from disk):
    only the current layer's Hessians exist at any time.

    Under torchrun (torch.distributed initialized) every rank runs each layer's forward and Hessians (the same
    arithmetic), quantizes only its share of the layer's linears (`assign_linears`: GPTQ's cost dominates the
    forward) and the integers are all-gathered before the next layer, so every rank ends with all of them,
    equal bit for bit to one process with the same threads (tests/test_gptq_dist.py).

    inputs: "dense": each layer's inputs come from the unquantized previous layers (the Hessians, hence the
    integers, equal those of one pass of the unquantized model: `input_hessians`); "quantized": from the
    already quantized previous layers (sequential GPTQ, as llm-compressor runs it).
    sink(i, {fqn: QuantizedWeight}): receives each layer's integers instead of returning them (a streamed
    run then holds no integers either), while layer i is still loaded. Quantized weights replace the layer's weights (dequantized), in
    place; a streamed layer is freed after. Linears outside the decoder layers are not quantized here.
    """
    import torch

    from llmcompress.dist import world
    from llmcompress.io.stream import return_freed_memory
    from llmcompress.progress import track
    from llmcompress.quant.apply import QuantizedWeight

    if inputs not in INPUTS:
        raise ValueError(f"inputs must be one of {INPUTS}")
    model = runner.model
    prefixes = [runner.layer_prefix(i) for i in range(runner.n_layers)]
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    targets = plan.quantized(names)
    outside = [f for f in targets if not f.startswith(runner.adapter.layers + ".")]
    if outside:
        raise ValueError(f"GPTQ layer by layer covers decoder linears only; the plan also names {outside[0]}")
    out: dict[str, QuantizedWeight] = {}
    info = world()
    hidden = runner.embed(blocks)
    steps = range(runner.n_layers)
    for i in track(steps, "quantizing (GPTQ, layer by layer)", total=len(steps)) if progress else steps:
        mine = [f for f in targets if f.startswith(prefixes[i])]
        with runner.layer(i) as layer:
            outs, hessians = layer_hessians(runner, i, layer, mine, hidden)
            linears = {fqn: layer.get_submodule(fqn[len(prefixes[i]):]) for fqn in mine}
            share = set(assign_linears({f: tuple(m.weight.shape) for f, m in linears.items()}, info.world_size)[info.rank])
            got = {}
            for fqn in mine:
                h = hessians.pop(fqn)  # popped: a Hessian is freed once its last linear is done (q/k/v share one)
                if fqn in share:
                    cfg, lin = targets[fqn], linears[fqn]
                    q, s, z = gptq_quantize(lin.weight.data, h, cfg.bits, cfg.group_size, act_order=act_order, sym=cfg.sym)
                    got[fqn] = QuantizedWeight(q.cpu(), s.cpu(), z.cpu(), cfg.bits, cfg.group_size, cfg.sym)
                    del q, s, z
                del h  # another rank's linear too: never kept through the exchange (down_proj's is the largest)
                if runner.streamed:
                    return_freed_memory()
            del hessians
            if info.active:
                got = _exchange(got, info)
            for fqn in mine:  # the weights become their dequantized values (after the exchange: every rank's share)
                lin = linears[fqn]
                with torch.no_grad():
                    lin.weight.copy_(got[fqn].dequantize(lin.weight.dtype).to(lin.weight.device))
            if inputs == "quantized" and mine:
                outs = [runner.run(i, layer, h) for h in hidden]
            if sink is not None:  # while the layer is loaded: a writer can take its other tensors too
                sink(i, got)
            else:
                out.update(got)
        hidden = outs
    return out


def gptq_model_(model: nn.Module, plan: MixedPrecisionPlan, blocks: torch.Tensor, progress: bool = True,
                act_order: bool = False, inputs: str = "dense", sink=None) -> dict[str, QuantizedWeight]:
    """GPTQ-quantize every linear the plan names, layer by layer (one layer's Hessians at a time; with the
    default `inputs="dense"` the integers are those of Hessians from one pass of the unquantized model);
    the weights become their dequantized values in place. Returns the integer weights, as quantize_model_.
    act_order: see gptq_quantize; inputs, sink: see gptq_layerwise_. Planned linears outside the decoder
    layers (a quantized lm_head) are quantized after them, with Hessians from the unquantized model."""
    import torch

    from llmcompress.io.stream import LayerRunner
    from llmcompress.quant.apply import QuantizedWeight, linear_fqns
    from llmcompress.quant.plan import MixedPrecisionPlan as Plan

    targets = plan.quantized(linear_fqns(model))
    runner = LayerRunner(model)
    inner = Plan()
    for fqn, cfg in targets.items():
        if fqn.startswith(runner.adapter.layers + "."):
            inner[fqn] = cfg
    inner["_default"] = None
    rest = {f: c for f, c in targets.items() if f not in inner.quantized(list(targets))}
    # Hessians of planned linears outside the layers (a quantized lm_head): from the unquantized model, first
    rest_h = input_hessians(model, list(rest), blocks.to(runner.device)) if rest else {}
    out = gptq_layerwise_(runner, inner, blocks.to(runner.device), act_order=act_order, inputs=inputs, sink=sink, progress=progress)
    if rest:
        modules = dict(model.named_modules())
        hessians = rest_h
        for fqn, cfg in rest.items():
            lin = modules[fqn]
            q, s, z = gptq_quantize(lin.weight.data, hessians.pop(fqn), cfg.bits, cfg.group_size, act_order=act_order, sym=cfg.sym)
            qw = QuantizedWeight(q.cpu(), s.cpu(), z.cpu(), cfg.bits, cfg.group_size, cfg.sym)
            with torch.no_grad():
                lin.weight.copy_(qw.dequantize(lin.weight.dtype).to(lin.weight.device))
            out[fqn] = qw
    return out


__all__ = ["assign_linears", "gptq_layerwise_", "gptq_model_", "gptq_quantize", "input_hessians", "layer_hessians"]
