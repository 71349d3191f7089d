"""Mixture of experts and grouped GEMMs as custom ops.

- ``grouped_mm(a, b, offs) -> out``: ``torch._grouped_mm``'s semantics for 2-D ``a`` ``[M, K]`` and
  3-D ``b`` ``[G, K, N]`` (or the transpose of a contiguous ``[G, N, K]``): rows
  ``[offs[g-1], offs[g])`` of ``a`` times ``b[g]``; ``offs`` int32 ``[G]`` cumulative row ends,
  nondecreasing, the last = M. Autograd: ``da = grouped_mm(dout, bᵀ, offs)`` and the per-group
  weight gradient ``db[g] = a_gᵀ·dout_g`` (a K-grouped GEMM).
- ``moe(x, router, w_up, w_down, top_k, ...) -> (out, aux_loss)``: the whole layer — router
  (softmax or sigmoid scores, optional group-limited routing, top-k, renormalisation), the padded
  expert-contiguous layout planned on the device, the grouped SwiGLU/GEGLU expert MLP and the
  weighted combine — with its backward. ``router`` is ``[E, H]`` (an ``nn.Linear(H, E)``
  weight), ``w_up`` ``[E, H, 2I]`` (gate columns first), ``w_down`` ``[E, I, H]``. ``aux_loss``
  (0-dim float32) is the Switch load-balancing loss ``aux_loss_coef·E·Σ f_e·P_e`` plus the router
  z-loss ``z_loss_coef·mean(logsumexp(logits)²)``; add it to the training loss and its gradient
  flows to the router (read on the device: no host synchronisation).
- ``moe_metrics(...)``: tokens per expert, dropped pairs, balance — of a forward's saved state.

The layer's op returns every buffer its backward reads (the layout's rows are ``T·k + E·127``:
each expert's segment padded to 128 rows), so shapes are static for ``torch.compile`` and no
step waits for the host. CPU and CUDA; float32/float16/bfloat16.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _native
from ._eager import eager
from ._ops import _check_tensors, _desc, _describe, _fail, _native_call, _where

_ALIGN = 128


def _grouped_check(op: str, a: Tensor, b: Tensor, offs: Tensor) -> List[int]:
    _check_tensors(op, [("a", a), ("b", b)])
    if a.dim() != 2:
        _fail(op, "a", "a 2-D [rows, k] tensor", _describe(a))
    if b.dim() != 3 or b.shape[1] != a.shape[1] or b.dtype != a.dtype:
        _fail(op, "b", f"a {a.dtype} [groups, {a.shape[1]}, n]", _describe(b))
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.shape[0] != b.shape[0] or offs.device != a.device:
        _fail(op, "offs", f"an int32 [{b.shape[0]}] of cumulative row ends on {a.device}", _describe(offs))
    return [a.shape[0], b.shape[2]]


def _b_operand(b: Tensor) -> Tensor:
    """b as ferrite reads it: contiguous [G, K, N], or the transpose of a contiguous [G, N, K]."""
    if b.is_contiguous() or b.transpose(1, 2).is_contiguous():
        return b
    return b.contiguous()


@torch.library.custom_op("ferrite::grouped_mm", mutates_args=())
def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    op = "ferrite.grouped_mm"
    shape = _grouped_check(op, a, b, offs)
    out = a.new_empty(shape)
    dev, stream = _where(a)
    _native_call(_native.grouped_mm, a.contiguous(), _b_operand(b), offs.contiguous(), out, device=dev, stream=stream)
    return out


@_grouped_mm.register_fake
def _(a, b, offs):
    return a.new_empty(_grouped_check("ferrite.grouped_mm", a, b, offs))


@torch.library.custom_op("ferrite::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(grad: Tensor, a: Tensor, b: Tensor, offs: Tensor, need_a: bool, need_b: bool) -> Tuple[Tensor, Tensor]:
    op = "ferrite.grouped_mm_backward"
    _grouped_check(op, a, b, offs)
    dev, stream = _where(a)
    g = grad.contiguous()
    da = a.new_empty(a.shape)
    db = b.new_empty(b.shape)
    if need_a:
        _native_call(_native.grouped_mm, g, _b_operand(b).transpose(1, 2), offs.contiguous(), da, device=dev, stream=stream)
    else:
        da.zero_()
    if need_b:
        _native_call(_native.grouped_mm_weight_grad, a.contiguous(), g, offs.contiguous(), db, device=dev, stream=stream)
    else:
        db.zero_()
    return da, db


@_grouped_mm_backward.register_fake
def _(grad, a, b, offs, need_a, need_b):
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _grouped_setup(ctx, inputs, output):
    a, b, offs = inputs
    ctx.need = (a.requires_grad, b.requires_grad)
    ctx.save_for_backward(a, b, offs)


def _grouped_bwd(ctx, grad):
    a, b, offs = ctx.saved_tensors
    da, db = eager.grouped_mm_backward(grad, a, b, offs, ctx.need[0], ctx.need[1])
    return (da if ctx.need[0] else None), (db if ctx.need[1] else None), None


_grouped_mm.register_autograd(_grouped_bwd, setup_context=_grouped_setup)


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """Rows ``[offs[g-1], offs[g])`` of ``a`` times ``b[g]`` (``torch._grouped_mm`` for 2-D a, 3-D b)."""
    return eager.grouped_mm(a, b, offs)


# ----------------------------------------------------------------------------------------------
# the layer

_SAVED = 14  # MoeForward's buffers: out, logits, probs, lse, idx, weights, pos, src, ends,
#              counts, stats, losses, xp, hpre


def _moe_shapes(op: str, x: Tensor, router: Tensor, w_up: Tensor, w_down: Tensor, top_k: int):
    _check_tensors(op, [("x", x), ("router", router), ("w_up", w_up), ("w_down", w_down)])
    if x.dim() != 2:
        _fail(op, "x", "a 2-D [tokens, hidden] tensor", _describe(x))
    t, h = x.shape
    if router.dim() != 2 or router.shape[1] != h:
        _fail(op, "router", f"[experts, {h}]", _describe(router))
    e = router.shape[0]
    if w_up.dim() != 3 or w_up.shape[0] != e or w_up.shape[1] != h or w_up.shape[2] % 2:
        _fail(op, "w_up", f"[{e}, {h}, 2·inter]", _describe(w_up))
    i = w_up.shape[2] // 2
    if w_down.dim() != 3 or tuple(w_down.shape) != (e, i, h):
        _fail(op, "w_down", f"[{e}, {i}, {h}]", _describe(w_down))
    if not (1 <= top_k <= e):
        _fail(op, "top_k", f"1..={e}", str(top_k))
    rows = t * top_k + e * (_ALIGN - 1)
    f32, i32, dt = torch.float32, torch.int32, x.dtype
    return [
        ([t, h], dt), ([t, e], dt), ([t, e], f32), ([t], f32), ([t, top_k], i32), ([t, top_k], f32),
        ([t * top_k], i32), ([rows], i32), ([e], i32), ([e], i32), ([2], i32), ([2 + e], f32),
        ([rows, h], dt), ([rows, 2 * i], dt),
    ]


def _cfg_kwargs(top_k, score, renormalize, groups, topk_groups, routed_scale, capacity_factor, aux_loss_coef, z_loss_coef, activation):
    return dict(
        top_k=int(top_k), score=score, renormalize=bool(renormalize), groups=int(groups), topk_groups=int(topk_groups),
        routed_scale=float(routed_scale), capacity_factor=None if capacity_factor is None or capacity_factor <= 0 else float(capacity_factor),
        aux_loss_coef=float(aux_loss_coef), z_loss_coef=float(z_loss_coef), activation=activation,
    )


@torch.library.custom_op("ferrite::moe", mutates_args=())
def _moe(
    x: Tensor, router: Tensor, w_up: Tensor, w_down: Tensor, top_k: int, score: str, renormalize: bool, groups: int,
    topk_groups: int, routed_scale: float, capacity_factor: float, aux_loss_coef: float, z_loss_coef: float, activation: str,
    forward_only: bool,
) -> List[Tensor]:
    op = "ferrite.moe"
    shapes = _moe_shapes(op, x, router, w_up, w_down, top_k)
    saved = [torch.empty(s, dtype=d, device=x.device) for s, d in shapes]
    dev, stream = _where(x)
    _native_call(
        _native.moe_forward, x.contiguous(), router.contiguous(), w_up.contiguous(), w_down.contiguous(),
        [_desc(t) for t in saved],
        device=dev, stream=stream, forward_only=bool(forward_only),
        **_cfg_kwargs(top_k, score, renormalize, groups, topk_groups, routed_scale, capacity_factor, aux_loss_coef, z_loss_coef, activation),
    )
    return saved


@_moe.register_fake
def _(x, router, w_up, w_down, top_k, score, renormalize, groups, topk_groups, routed_scale, capacity_factor, aux_loss_coef, z_loss_coef, activation, forward_only):
    return [x.new_empty(s, dtype=d) for s, d in _moe_shapes("ferrite.moe", x, router, w_up, w_down, top_k)]


def _moe_backward_run(grad, loss_grad, x, router, w_up, w_down, saved, cfg):
    """The native backward; ``saved[13]`` (hpre) receives the pre-activations' gradient on CUDA."""
    grads = [t.new_empty(t.shape) for t in (x, router, w_up, w_down)]
    saved = [t.contiguous() for t in saved]
    dev, stream = _where(x)
    _native_call(
        _native.moe_backward, grad.contiguous(), x.contiguous(), router.contiguous(), w_up.contiguous(), w_down.contiguous(),
        [_desc(t) for t in saved], [_desc(t) for t in grads], loss_grad=loss_grad.contiguous(), device=dev, stream=stream,
        **_cfg_kwargs(*cfg),
    )
    return grads


@torch.library.custom_op("ferrite::moe_backward", mutates_args=())
def _moe_backward(
    grad: Tensor, loss_grad: Tensor, x: Tensor, router: Tensor, w_up: Tensor, w_down: Tensor, saved: List[Tensor],
    top_k: int, score: str, renormalize: bool, groups: int, topk_groups: int, routed_scale: float, capacity_factor: float,
    aux_loss_coef: float, z_loss_coef: float, activation: str,
) -> List[Tensor]:
    """The functional backward (what a traced graph runs): the forward's buffers stay as they
    were, at the cost of a copy of hpre that the kernels overwrite."""
    cfg = (top_k, score, renormalize, groups, topk_groups, routed_scale, capacity_factor, aux_loss_coef, z_loss_coef, activation)
    saved = list(saved[:13]) + [saved[13].clone()]
    return _moe_backward_run(grad, loss_grad, x, router, w_up, w_down, saved, cfg)


@_moe_backward.register_fake
def _(grad, loss_grad, x, router, w_up, w_down, saved, *cfg):
    return [t.new_empty(t.shape) for t in (x, router, w_up, w_down)]


@torch.library.custom_op("ferrite::moe_backward_", mutates_args=("hpre",))
def _moe_backward_(
    grad: Tensor, loss_grad: Tensor, x: Tensor, router: Tensor, w_up: Tensor, w_down: Tensor, saved: List[Tensor],
    hpre: Tensor, top_k: int, score: str, renormalize: bool, groups: int, topk_groups: int, routed_scale: float,
    capacity_factor: float, aux_loss_coef: float, z_loss_coef: float, activation: str,
) -> List[Tensor]:
    """The eager backward: the pre-activations' gradient is written over ``hpre`` (the forward's
    saved ``[rows, 2I]`` buffer), so the backward allocates no second one — at the Mixtral-like
    shape 0.97 GB less at its peak. ``saved``: the forward's other 13 buffers."""
    cfg = (top_k, score, renormalize, groups, topk_groups, routed_scale, capacity_factor, aux_loss_coef, z_loss_coef, activation)
    return _moe_backward_run(grad, loss_grad, x, router, w_up, w_down, list(saved) + [hpre], cfg)


@_moe_backward_.register_fake
def _(grad, loss_grad, x, router, w_up, w_down, saved, hpre, *cfg):
    return [t.new_empty(t.shape) for t in (x, router, w_up, w_down)]


def _moe_setup(ctx, inputs, output):
    ctx.cfg = inputs[4:-1]  # the layer's configuration (forward_only last: not the backward's)
    ctx.save_for_backward(*inputs[:4], *output)
    # Only out and the losses carry gradients: no zero tensors for the other buffers (the layout
    # ones are GBs at real sizes — filling them cost more than a GEMM).
    ctx.set_materialize_grads(False)


def _moe_bwd(ctx, grads):
    if getattr(ctx, "grad_used", False):
        raise RuntimeError(
            "ferrite.moe: a second backward through the same layer call (retain_graph=True) is not "
            "supported: the first one wrote its gradients over the saved pre-activations"
        )
    st = ctx.saved_tensors
    x, router, w_up, w_down, saved = st[0], st[1], st[2], st[3], list(st[4:])
    dout = grads[0] if grads[0] is not None else torch.zeros_like(saved[0])
    lg = grads[11]
    loss_grad = lg.to(torch.float32) if lg is not None else torch.zeros(2, dtype=torch.float32, device=x.device)
    traced = (
        torch.compiler.is_compiling()
        or type(saved[13]) is not Tensor
        or torch._C._len_torch_dispatch_stack() > 0
    )
    if traced:
        dx, dr, du, dd = eager.moe_backward(dout, loss_grad, x, router, w_up, w_down, saved, *ctx.cfg)
    else:
        ctx.grad_used = True
        dx, dr, du, dd = torch.ops.ferrite.moe_backward_(
            dout, loss_grad, x, router, w_up, w_down, saved[:13], saved[13], *ctx.cfg
        )
    return (dx, dr, du, dd) + (None,) * 11


_moe.register_autograd(_moe_bwd, setup_context=_moe_setup)


def moe_forward(
    x: Tensor, router: Tensor, w_up: Tensor, w_down: Tensor, top_k: int, score: str = "softmax", renormalize: bool = True,
    groups: int = 1, topk_groups: int = 1, routed_scale: float = 1.0, capacity_factor: Optional[float] = None,
    aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, activation: str = "silu",
) -> List[Tensor]:
    """The layer's op itself: every buffer of the forward (see ``_SAVED``); ``moe`` is the usual entry.
    Where no gradient can flow (``torch.no_grad()``, or no input requires one) the forward is run
    forward-only: the pre-activations the backward would read are not written (``saved[13]``
    then holds no values)."""
    cf = 0.0 if capacity_factor is None else float(capacity_factor)
    if capacity_factor is not None and not cf > 0:
        _fail("ferrite.moe", "capacity_factor", "None (dropless) or a value > 0", repr(capacity_factor))
    forward_only = not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, router, w_up, w_down)))
    return eager.moe(x, router, w_up, w_down, int(top_k), score, bool(renormalize), int(groups), int(topk_groups),
                     float(routed_scale), cf, float(aux_loss_coef), float(z_loss_coef), activation, forward_only)


def moe(
    x: Tensor, router: Tensor, w_up: Tensor, w_down: Tensor, top_k: int, score: str = "softmax", renormalize: bool = True,
    groups: int = 1, topk_groups: int = 1, routed_scale: float = 1.0, capacity_factor: Optional[float] = None,
    aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, activation: str = "silu",
) -> Tuple[Tensor, Tensor]:
    """A mixture-of-experts layer over ``x`` ``[..., H]``: returns ``(out [..., H], aux_loss)``."""
    lead = x.shape[:-1]
    saved = moe_forward(x.reshape(-1, x.shape[-1]), router, w_up, w_down, top_k, score, renormalize, groups, topk_groups,
                        routed_scale, capacity_factor, aux_loss_coef, z_loss_coef, activation)
    losses = saved[11]
    return saved[0].reshape(*lead, x.shape[-1]), losses[0] + losses[1]


def moe_metrics(saved: List[Tensor]) -> dict:
    """Tokens per expert, dropped pairs, rows used, losses and balance of a forward's buffers
    (``moe_forward``'s list); reads the device."""
    counts = saved[9].cpu().tolist()
    stats = saved[10].cpu().tolist()
    losses = saved[11].cpu().tolist()
    mx = max(counts) if counts else 0
    mean = sum(counts) / max(len(counts), 1)
    return {
        "tokens_per_expert": counts, "dropped": stats[0], "rows_used": stats[1], "aux_loss": losses[0],
        "z_loss": losses[1], "experts_used": sum(c > 0 for c in counts) / max(len(counts), 1),
        "max_load": mx, "mean_load": mean, "balance": mean / mx if mx else 0.0,
    }
