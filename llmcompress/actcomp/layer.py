"""The compressed linear and `compress_activations`, the context manager that patches it onto a model.

Inside `with compress_activations(model, rank=...) as ac:` every `nn.Linear` whose weight trains saves,
for backward, the sketch X·P of its input instead of X (sketch.py has the math). What is exact and what
is estimated:

* exact: the forward output; the input gradient dX = δW (it needs only W); the bias gradient; every
  non-linear operation (norms, attention, activation functions, softmax, loss) - they are never
  compressed and keep what they save;
* unbiased estimate: the weight gradient (δᵀXP)Pᵀ, E = δᵀX; variance (d_in + 1)/r ‖δᵀX‖² (Gaussian P);
* co-compression (`co_compress=True`): the weight gradient is not materialised; its factors
  U = δᵀXP (d_out × r) and V = Pᵀ (r × d_in) are handed to `on_factors(name, module, U, V)` (gradient
  communication can send U and the seed instead of d_out × d_in numbers) and kept in `ac.factors`.
  `ac.sgd_step(lr)` applies W -= lr·UV from the factors: exactly the SGD step on the dense estimate.
  For AdamW and other per-parameter optimisers, `optim.FactoredStep` forms one linear's dense gradient
  at a time, steps it and frees it (the same update, one dense gradient held instead of all);
  `ac.materialize()` writes every UV into `.grad` at once (no memory saved on the gradient).

P is drawn from a generator seeded by (seed, step, draw) - one draw per sketched input in call order -
and regenerated in backward, never stored; `set_step(step)` makes a resumed run draw the same P's, and
`state_dict()` (seed, step, draw, auto ranks and their statistics) is the rest of the state.

An input whose storage the graph already holds (saved by an earlier operation: with PyTorch's CPU
flash attention the o_proj input is a view of the attention output it saves) is not sketched: the exact
linear saves a view of it at no cost, a sketch would only add bytes. This needs the saved-bytes counter
(`count=True`, the default), which knows what was packed so far in the step.

Inputs shared by several linears (q/k/v read the same normed hidden state; gate/up the same) are
sketched once: a linear called on the very tensor the previous sketched linear was called on (same
object, unmodified) reuses its sketch and seed, so the graph holds one N × r tensor for the group.

bf16 autocast: the sketch is taken and saved in the autocast dtype (as autocast's own cast of X would
be), gradients are computed from it and returned in the parameters' dtype. The compressed Functions cast
W to the autocast dtype themselves, with autocast off (`_forward_linear`): autocast's own cast of a
trained leaf weight would go into its weight cache and stay alive until the autocast region exits. torch.compile: not supported
- dynamo graph-breaks on the Python-side sketch sharing and seed counter, and compiled autograd runs the
saved-tensor hooks of a whole graph at once, so the per-step byte count and the one-sketch-per-group
sharing cannot be guaranteed; `compress_activations` refuses a compiled module.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmcompress.actcomp.sketch import allocate_ranks, grad_factors, projection, projection_seed, resolve_rank


@dataclass
class _Info:
    name: str
    index: int
    d_in: int


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.is_floating_point():
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _forward_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for the compressed Functions' forward. Under autocast the operands are cast here, with
    autocast off: autocast's own cast of a leaf weight that requires grad goes into its weight cache, which
    keeps a low-precision copy of every trained weight alive until the autocast region exits (the whole
    forward, or forward and backward if backward runs inside it), so the memory the compressed path saves
    would be spent again on those copies. Cast here, the copy is freed as soon as the product exists."""
    dev = x.device.type
    if not (torch.is_autocast_enabled(dev) and x.is_floating_point()):
        return F.linear(x, weight, bias)
    dt = torch.get_autocast_dtype(dev)
    with torch.autocast(dev, enabled=False):
        return F.linear(x.to(dt), weight.to(dt), None if bias is None else bias.to(dt))


class _SketchedLinear(torch.autograd.Function):
    """y = x Wᵀ + b; saves (W, sketch); backward: exact dX and db, (δᵀ·sketch)·Pᵀ for dW."""

    @staticmethod
    def forward(x, weight, bias, xs, seed, comp, name, group):
        return _forward_linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, xs, seed, comp, name, group = inputs
        ctx.save_for_backward(weight, xs)
        ctx.seed, ctx.comp, ctx.name, ctx.group = seed, comp, name, group
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad_out):
        weight, xs = ctx.saved_tensors
        d_out, d_in = weight.shape
        g = grad_out.reshape(-1, d_out)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (g @ weight.to(g.dtype)).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            p = projection(d_in, xs.shape[1], ctx.seed, ctx.comp.kind, device=xs.device, dtype=xs.dtype)
            u, v = grad_factors(g, xs, p)
            ctx.comp._observe(ctx.group, u)
            if ctx.comp.co_compress:
                ctx.comp._factors(ctx.name, u, v)
            else:
                dw = (u @ v).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0).to(weight.dtype)
        return dx, dw, db, None, None, None, None, None


class _HeldLinear(torch.autograd.Function):
    """y = x Wᵀ + b for an input the graph already holds: saves (W, x) - both already in memory, so unlike
    autocast's F.linear no bf16 copy of W is kept - and computes the exact gradients."""

    @staticmethod
    def forward(x, weight, bias):
        return _forward_linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.save_for_backward(weight, x)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad_out):
        weight, x = ctx.saved_tensors
        g = grad_out.reshape(-1, weight.shape[0])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (g @ weight.to(g.dtype)).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = (g.t() @ x.reshape(-1, weight.shape[1]).to(g.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0).to(weight.dtype)
        return dx, dw, db


class _FrozenLinear(torch.autograd.Function):
    """y = x Wᵀ + b with W frozen: only dX = δW is needed, so only W (already in memory) is saved - autocast's
    F.linear would keep a bf16 copy of W (54 MiB for smollm2's 49k x 576 head)."""

    @staticmethod
    def forward(x, weight, bias):
        return _forward_linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.save_for_backward(weight)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype

    @staticmethod
    def backward(ctx, grad_out):
        (weight,) = ctx.saved_tensors
        g = grad_out.reshape(-1, weight.shape[0])
        return (g @ weight.to(g.dtype)).reshape(ctx.x_shape).to(ctx.x_dtype), None, None


class ActCompressor:
    """The state of one `compress_activations` context (see the module docstring).

    Attributes:
        rank: int (the same rank everywhere), float in (0, 1) (that fraction of each input's width),
            "auto" (per-input ranks from `budget`, see `allocate_ranks`) or None (nothing compressed:
            only the saved bytes are counted).
        budget: for "auto": the sketches' share of the uncompressed linear-input bytes.
        counter: the SavedBytes of the context (None when counting is off).
        groups: leader linear name -> names of the linears that shared its sketch (seen so far).
    """

    def __init__(self, modules: dict[str, nn.Linear], rank, *, budget: float = 0.25, kind: str = "gaussian", seed: int = 0,
                 co_compress: bool = False, on_factors=None) -> None:
        self.modules = modules
        self.info = {m: _Info(n, i, m.in_features) for i, (n, m) in enumerate(modules.items())}
        self.rank, self.budget, self.kind, self.seed = rank, budget, kind, seed
        self.co_compress, self.on_factors = co_compress, on_factors
        self.step = 0
        self.draw = 0
        self.auto_ranks: dict[str, int | None] | None = None  # leader name -> rank, once allocated
        self.stats: dict[str, float] = {}  # leader name -> estimated ||dY^T X||^2 of its consumers
        self.groups: dict[str, list[str]] = {}
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.counter = None
        self._last = None

    # ---- state -------------------------------------------------------------------------------

    def set_step(self, step: int) -> None:
        """Start training step `step`: projections are drawn from (seed, step, 0), (seed, step, 1), ...
        With rank "auto", the first call after a step that gathered statistics fixes the ranks."""
        if self.rank == "auto" and self.auto_ranks is None and self.stats:
            self._allocate()
        self.step, self.draw, self._last = int(step), 0, None
        if self.counter is not None:
            self.counter.reset()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step, "draw": self.draw, "auto_ranks": self.auto_ranks, "stats": dict(self.stats)}

    def load_state_dict(self, st: dict) -> None:
        self.seed, self.step, self.draw = int(st["seed"]), int(st["step"]), int(st["draw"])
        self.auto_ranks = dict(st["auto_ranks"]) if st.get("auto_ranks") is not None else None
        self.stats = dict(st.get("stats") or {})
        self._last = None

    def _allocate(self) -> None:
        leaders = sorted(self.stats, key=lambda n: self.info[self.modules[n]].index)
        dims = [self.modules[n].in_features for n in leaders]
        ranks = allocate_ranks(dims, self.budget, [self.stats[n] for n in leaders])
        self.auto_ranks = dict(zip(leaders, ranks))

    def rank_for(self, info: _Info) -> int | None:
        if self.rank == "auto":
            if self.auto_ranks is not None and info.name in self.auto_ranks:
                return self.auto_ranks[info.name]
            return resolve_rank(float(self.budget), info.d_in) if self.budget < 1 else None
        return resolve_rank(self.rank, info.d_in)

    # ---- backward callbacks --------------------------------------------------------------------

    def _observe(self, group: str, u: torch.Tensor) -> None:
        if self.rank == "auto" and self.auto_ranks is None:
            self.stats[group] = self.stats.get(group, 0.0) + float(u.pow(2).sum())  # E||U||^2 = ||dY^T X||^2

    def _factors(self, name: str, u: torch.Tensor, v: torch.Tensor) -> None:
        if name in self.factors:  # the module ran twice in this step: the gradient is the sum
            u0, v0 = self.factors[name]
            u, v = torch.cat([u0, u], 1), torch.cat([v0, v], 0)
        self.factors[name] = (u, v)
        if self.on_factors is not None:
            self.on_factors(name, self.modules[name], u, v)

    def materialize(self) -> None:
        """Write U·V of every factored weight gradient into `.grad` (added), for optimisers such as AdamW."""
        for name, (u, v) in self.factors.items():
            w = self.modules[name].weight
            g = (u @ v).to(w.dtype)
            w.grad = g if w.grad is None else w.grad + g
        self.factors = {}

    @torch.no_grad()
    def sgd_step(self, lr: float) -> None:
        """W -= lr·U·V for every factored gradient (exact SGD on the estimate), then drop the factors."""
        for name, (u, v) in self.factors.items():
            w = self.modules[name].weight
            w.addmm_(u.to(w.dtype), v.to(w.dtype), alpha=-lr)
        self.factors = {}

    # ---- forward -------------------------------------------------------------------------------

    def linear(self, module: nn.Linear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not torch.is_grad_enabled() or self.rank is None:
            return F.linear(x, weight, bias)
        if not weight.requires_grad:
            if x.requires_grad and not (bias is not None and bias.requires_grad):
                return _FrozenLinear.apply(x, weight, bias)
            return F.linear(x, weight, bias)
        info = self.info[module]
        last = self._last
        if last is not None and last[0]() is x and last[1] == x._version and last[2].shape[0] * info.d_in == x.numel():
            _, _, xs, seed, group = last
            if info.name != group and info.name not in self.groups[group]:
                self.groups[group].append(info.name)
        else:
            r = self.rank_for(info)
            if r is None:
                self._last = None
                return F.linear(x, weight, bias)
            if self.counter is not None and self.counter.holds(x):  # already held: saving it is free, and exact
                self._last = None
                return _HeldLinear.apply(x, weight, bias)
            seed = projection_seed(self.seed, self.step, self.draw)
            self.draw += 1
            dtype = _compute_dtype(x)
            p = projection(info.d_in, r, seed, self.kind, device=x.device, dtype=dtype)
            with torch.no_grad():
                xs = x.detach().reshape(-1, info.d_in).to(dtype) @ p
            group = info.name
            self.groups.setdefault(group, [])
            self._last = (weakref.ref(x), x._version, xs, seed, group)
            if self.counter is not None and self.counter._decoder:  # the counter's linear_input category
                self.counter.uncompressed_linear_input += x.numel() * torch.empty((), dtype=dtype).element_size()
        return _SketchedLinear.apply(x, weight, bias, xs, seed, self, info.name, group)


def linear(module: nn.Linear, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for `module`, compressed when the module is inside a `compress_activations`.

    For code that computes a linear's weight itself (e.g. the NAS supernet's mixed weights) and so
    replaces the module's forward: calling this instead of F.linear keeps it compressible.
    """
    weight = module.weight if weight is None else weight
    comp = module.__dict__.get("_actcomp")
    if comp is None:
        return F.linear(x, weight, bias)
    return comp.linear(module, x, weight, bias)


def _decoder_layers(roots: list[nn.Module]) -> list[nn.Module]:
    from llmcompress.errors import UnsupportedArchitecture
    from llmcompress.io.adapters import get_adapter

    if len(roots) == 1 and hasattr(roots[0], "config"):
        try:
            return list(get_adapter(roots[0]).decoder_layers(roots[0]))
        except UnsupportedArchitecture:
            return []
    if len(roots) == 1 and isinstance(roots[0], nn.ModuleList):
        return list(roots[0])
    return roots


@contextmanager
def compress_activations(model, rank=None, *, budget: float = 0.25, kind: str = "gaussian", seed: int = 0,
                         co_compress: bool = False, on_factors=None, count: bool = True, include=None):
    """Patch every `nn.Linear` of `model` (a module, or a list of modules) with the compressed linear.

    Args:
        model: what to patch (a whole model, or the decoder layers a loop trains).
        rank: int, fraction of each input's width (float < 1), "auto", or None (count saved bytes only).
        budget: for rank "auto": the sketches' share of the uncompressed linear-input bytes.
        kind: "gaussian" or "rademacher" projections.
        seed: base seed of the projections (with the step and the draw index).
        co_compress: keep weight gradients as factors (see the module docstring).
        on_factors: callback(name, module, U, V) for each factored gradient (co_compress).
        count: count saved-for-backward bytes (`ac.counter`, see counter.py).
        include: predicate on a linear's qualified name (default: every nn.Linear).

    Yields the ActCompressor; on exit every module is restored (forward and attributes).
    """
    from llmcompress.actcomp.counter import count_saved

    roots = list(model) if isinstance(model, (list, tuple)) else [model]
    if any(type(r).__name__ == "OptimizedModule" for r in roots):
        raise ValueError("compress_activations does not work on a torch.compile'd module (see llmcompress/actcomp/layer.py); "
                         "compress the uncompiled model")
    mods: dict[str, nn.Linear] = {}
    for i, root in enumerate(roots):
        for name, m in root.named_modules():
            full = f"{i}.{name}" if len(roots) > 1 else name
            if isinstance(m, nn.Linear) and m not in mods.values() and (include is None or include(full)):
                mods[full] = m
    ac = ActCompressor(mods, rank, budget=budget, kind=kind, seed=seed, co_compress=co_compress, on_factors=on_factors)
    patched = []
    for m in mods.values():
        m.__dict__["_actcomp"] = ac
        if "forward" not in m.__dict__:  # an instance forward set by someone else calls linear() itself
            m.forward = (lambda mod: (lambda x: ac.linear(mod, x, mod.weight, mod.bias)))(m)
            patched.append(m)
    try:
        if count:
            with count_saved(roots, _decoder_layers(roots)) as c:
                ac.counter = c
                yield ac
        else:
            yield ac
    finally:
        for m in mods.values():
            m.__dict__.pop("_actcomp", None)
        for m in patched:
            m.__dict__.pop("forward", None)
        ac._last = None


class _CountOnly:
    """What `training()` yields without compression: the saved-bytes counter, the same methods."""

    rank = None

    def __init__(self, counter) -> None:
        self.counter = counter

    def set_step(self, step: int) -> None:
        self.counter.reset()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, st: dict) -> None:
        pass


@contextmanager
def training(modules, rank=None, *, budget: float = 0.25, seed: int = 0, co_compress: bool = False):
    """The context a training loop puts around its steps (distill, nas): `compress_activations` when `rank`
    is set, else only the saved-bytes count; either way call `set_step(step)` at every step. With
    `co_compress` (needs `rank`) the loop steps its optimizer through `optim.stepper(opt, ac)`."""
    from llmcompress.actcomp.counter import count_saved

    if rank is not None:
        with compress_activations(modules, rank, budget=budget, seed=seed, co_compress=co_compress) as ac:
            yield ac
        return
    if co_compress:
        raise ValueError("co_compress needs a rank: without compression there are no gradient factors")
    roots = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    with count_saved(roots, _decoder_layers(roots)) as c:
        yield _CountOnly(c)


def summary(ac, steps: int, seconds: float, into: dict | None = None) -> dict:
    """The run report's figures of one training loop: peak saved bytes by category, step time, rank.

    With `into` (the figures of earlier loops of the same run), bytes keep the larger value and step
    times are averaged over all steps.
    """
    s = ac.counter.summary() if ac.counter is not None else {}
    s = {**s, "act_rank": ac.rank if ac.rank is None or isinstance(ac.rank, (int, str)) else float(ac.rank),
         "act_grad": "factored" if getattr(ac, "co_compress", False) else "dense",
         "steps": steps, "step_s": round(seconds / max(1, steps), 4)}
    fs = getattr(ac, "stepper", None)
    if fs is not None:  # a FactoredStep stepped this loop: what it measured
        s["factored_weights"] = fs.factored_weights
        s["factored_peak_dense_grad_bytes"] = fs.peak_dense_grad_bytes
    if getattr(ac, "auto_ranks", None):
        s["auto_ranks"] = dict(ac.auto_ranks)
    if into:
        n = into.get("steps", 0) + steps
        step_s = (into.get("step_s", 0.0) * into.get("steps", 0) + seconds) / max(1, n)
        s = {**into, **{k: max(v, into.get(k, 0)) for k, v in s.items() if k.endswith("_bytes") or k == "factored_weights"},
             "steps": n, "step_s": round(step_s, 4)}
    return s
