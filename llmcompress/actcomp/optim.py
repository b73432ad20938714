"""`FactoredStep`: the optimizer step of co-compression, applied from the weight gradients' low-rank factors.

With `compress_activations(..., co_compress=True)` a sketched linear's backward does not write `.grad`: it
hands over U = δᵀXP (d_out × r) and V = Pᵀ (r × d_in), whose product is the sketched weight gradient
(layer.py). `FactoredStep` wraps an ordinary torch optimizer over all trained parameters and steps it:

    opt = torch.optim.AdamW(params, lr=5e-4)
    with compress_activations(model, rank=0.125, co_compress=True) as ac:
        fs = FactoredStep(opt, ac)
        for step, ids in enumerate(batches):
            ac.set_step(step)
            causal_lm_loss(model, ids).backward()      # llmcompress/actcomp/loss.py
            fs.clip_grad_norm_(1.0)                     # the norm of dense grads and factored ones together
            fs.step()
            fs.zero_grad()

What it does, and what is exact:

* parameters with a dense `.grad` (norms, biases, linears whose input was not sketched) are stepped by
  the optimizer as usual, in one `optimizer.step()`;
* SGD without momentum (`torch.optim.SGD`, momentum 0, not maximize): W ← (1 − lr·wd)·W − lr·U·V, one
  `addmm_` per linear from the factors, no d_out × d_in gradient ever exists. The same update as dense
  SGD on the sketched gradient UV (exact up to float rounding order);
* any other optimizer whose update of a parameter depends only on that parameter's gradient and state
  (AdamW, Adam, SGD with momentum, RMSprop, Adagrad, ...): for ONE linear at a time the dense gradient
  G = U·V is formed, that parameter alone is stepped (the others have no `.grad` during the call), and G is
  freed before the next linear's is formed. The update is exactly the optimizer's on the sketched
  gradient; the memory held is one linear's dense gradient (the largest: d_out × d_in fp32) instead of
  every trained linear's. `peak_dense_grad_bytes` is measured at each materialisation (the bytes of the
  factored parameters' `.grad` alive then), not assumed;
* `clip_grad_norm_` computes the exact 2-norm of all gradients, the factored ones from r × r products
  (‖UV‖² = Σ (UᵀU) ⊙ (VVᵀ)), and scales U instead of a dense gradient.

What is approximate, or not saved:

* the sketched gradient itself: UV is an unbiased estimate of δᵀX (sketch.py). SGD on it stays an
  unbiased SGD step. AdamW is not linear in its gradient: its second moment averages (UV)², which is
  inflated by the sketch's variance, so steps come out smaller than AdamW on exact gradients, and the
  expected step is not the step of the expected gradient (the activation-compression theory covers SGD);
* the optimizer state stays dense (AdamW: 2 × the weights): Adam on the factors U in a moving subspace
  (GaLore-style) would be a different optimizer and is not done;
* optimizers that couple parameters (LBFGS; anything reading all gradients in one step) are refused.
  Step hooks of the optimizer run once per stepped linear, plus once for the dense step.
"""

from __future__ import annotations

import torch


class FactoredStep:
    """An optimizer step for the factored gradients of an `ActCompressor` (see the module docstring).

    Attributes:
        optimizer: the wrapped optimizer (its state_dict is the whole optimizer state).
        compressor: the ActCompressor whose `factors` are consumed by `step()`.
        peak_dense_grad_bytes: the largest total of dense `.grad` bytes of factored weights alive at
            once while stepping (measured at each materialisation; 0 when SGD steps from the factors).
        materialized: dense gradients formed in the last step.
        factored_weights: the most weights stepped from factors in one step so far (0: co-compression
            never took effect, e.g. no linear input was sketched).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, compressor) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("FactoredStep needs an optimizer that updates each parameter from its own gradient; LBFGS couples them")
        self.optimizer, self.compressor = optimizer, compressor
        self._group = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.peak_dense_grad_bytes = 0
        self.materialized = 0
        self.factored_weights = 0
        compressor.stepper = self  # summary() reports what it measured

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's (a loop sets the learning rate through them)."""
        return self.optimizer.param_groups

    def _items(self):
        """(weight, U, V) of every factored gradient, in module order."""
        out = []
        for name, (u, v) in self.compressor.factors.items():
            w = self.compressor.modules[name].weight
            if id(w) not in self._group:
                raise ValueError(f"{name}.weight has a factored gradient but is not in the optimizer")
            out.append((w, u, v))
        return out

    @staticmethod
    def _plain_sgd(opt, group) -> bool:
        return (type(opt) is torch.optim.SGD and not group.get("momentum") and not group.get("maximize")
                and not group.get("nesterov") and not group.get("differentiable"))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
        """Like torch.nn.utils.clip_grad_norm_ (2-norm) over the optimizer's dense grads and the factored ones."""
        items = self._items()
        total = torch.zeros((), dtype=torch.float32)
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    total += p.grad.float().pow(2).sum()
        for w, u, v in items:
            total += ((u.t() @ u) * (v @ v.t())).sum()
            if w.grad is not None:  # a dense part as well: the cross term 2<G, UV>
                total += 2 * ((w.grad.float() @ v.t()) * u).sum()
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + eps), max=1.0)
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))
        for _, u, _ in items:
            u.mul_(coef)
        return norm

    def _live_bytes(self, weights) -> int:
        return sum(w.grad.numel() * w.grad.element_size() for w in weights if w.grad is not None)

    @torch.no_grad()
    def step(self) -> None:
        """Step every parameter: dense grads first (one optimizer.step()), then each factored weight alone."""
        items = self._items()
        self.compressor.factors = {}
        self.factored_weights = max(self.factored_weights, len(items))
        fweights = [w for w, _, _ in items]
        own = {id(w): w.grad for w in fweights}  # a dense part of a factored weight (it also ran uncompressed)
        for w in fweights:
            w.grad = None
        self.optimizer.step()
        dense = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        kept = [p.grad for p in dense]
        for p in dense:  # hidden while single weights are stepped, so they are not stepped again
            p.grad = None
        self.materialized = 0
        try:
            for w, u, v in items:
                group = self._group[id(w)]
                extra = own.pop(id(w))
                if self._plain_sgd(self.optimizer, group) and extra is None:
                    lr, wd = float(group["lr"]), float(group.get("weight_decay") or 0.0)
                    if wd:
                        w.mul_(1 - lr * wd)
                    w.addmm_(u.to(w.dtype), v.to(w.dtype), alpha=-lr)
                    continue
                g = (u @ v).to(w.dtype)
                if extra is not None:
                    g += extra
                    del extra
                w.grad = g
                del g
                self.materialized += 1
                self.peak_dense_grad_bytes = max(self.peak_dense_grad_bytes, self._live_bytes(fweights))
                self.optimizer.step()
                w.grad = None
        finally:
            for p, g in zip(dense, kept):
                p.grad = g

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's zero_grad, and drop factors not yet stepped."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.compressor.factors = {}

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def stepper(optimizer: torch.optim.Optimizer, compressor):
    """What a training loop steps: `FactoredStep(optimizer, compressor)` when the compressor keeps factored
    gradients (`co_compress`), else the optimizer itself. Both have zero_grad, step, param_groups and
    state_dict; clip through `clip_grad_norm_(stepped, params, max_norm)`."""
    return FactoredStep(optimizer, compressor) if getattr(compressor, "co_compress", False) else optimizer


def clip_grad_norm_(stepped, params, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_(params, max_norm), or the FactoredStep's own (which sees the factors)."""
    if isinstance(stepped, FactoredStep):
        return stepped.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(params, max_norm)
