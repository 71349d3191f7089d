"""``ferrite.optim.AdamW``: ``torch.optim.AdamW``'s update as one fused ferrite step over many
tensors (one kernel launch per group of tensors sharing device, dtypes and step count).

Parameters may be float32 or bfloat16 (gradients of the parameter's dtype or float32). The
moments are float32; a bfloat16 parameter gets a float32 master copy in its state, the update runs
on the master and the parameter becomes the master rounded to nearest, so small updates are not
lost to bf16 rounding (``torch.optim.AdamW`` updates bf16 parameters in bf16). With float32
parameters the result matches ``torch.optim.AdamW`` (``foreach=False``) to float32 rounding.
"""

from typing import Iterable, Optional

import torch
from torch import Tensor

from . import _native
from ._ops import _desc, _describe, _where

__all__ = ["AdamW"]


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` (no amsgrad, no maximize)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        for name, ok, val in (
            ("lr", lr >= 0.0, lr),
            ("betas[0]", 0.0 <= betas[0] < 1.0, betas[0]),
            ("betas[1]", 0.0 <= betas[1] < 1.0, betas[1]),
            ("eps", eps > 0.0, eps),
            ("weight_decay", weight_decay >= 0.0, weight_decay),
        ):
            if not ok:
                raise ValueError(f"ferrite.optim.AdamW: argument `{name}`: out of range, got {val}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @staticmethod
    def _init_state(p: Tensor, state: dict) -> None:
        if p.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"ferrite.optim.AdamW: a parameter: expected dtype float32 or bfloat16, got {_describe(p)}"
            )
        if not p.is_contiguous():
            raise ValueError(f"ferrite.optim.AdamW: a parameter: expected a contiguous tensor, got {_describe(p)}")
        state["step"] = 0
        state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if p.dtype == torch.bfloat16:
            state["master"] = p.detach().float().contiguous()

    @torch.no_grad()
    def step(self, closure=None, grad_scale: Optional[float] = None):
        """One step. ``grad_scale`` multiplies the gradients first (e.g. 1/loss-scale)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            buckets = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("ferrite.optim.AdamW: sparse gradients are not supported")
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                # the step count advances only once the update has been made (below)
                key = (p.device, p.dtype, p.grad.dtype, state["step"] + 1)
                buckets.setdefault(key, []).append(p)
            for (_, _, _, step), ps in buckets.items():
                keep = []  # the tensors behind the descriptors, alive for the call
                descs = []
                for p in ps:
                    st = self.state[p]
                    g = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                    m = st.get("master")
                    keep.append((p, g, m))
                    descs.append(
                        (_desc(p), _desc(g), _desc(st["exp_avg"]), _desc(st["exp_avg_sq"]), None if m is None else _desc(m))
                    )
                dev, stream = _where(ps[0])
                _native.adamw_step(
                    descs,
                    float(group["lr"]),
                    beta1=float(b1),
                    beta2=float(b2),
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    step=int(step),
                    grad_scale=1.0 if grad_scale is None else float(grad_scale),
                    device=dev,
                    stream=stream,
                )
                del keep
                for p in ps:
                    self.state[p]["step"] = step
        return loss
