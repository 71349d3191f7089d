"""Fused elementwise and row ops as custom ops: softmax, bias + activation + dropout, the gated
units (SwiGLU / GEGLU) and softmax cross-entropy.

- ``softmax(x, scale) -> y`` over the last dim; backward ``softmax_backward(grad, y, scale)``.
- ``bias_act_dropout(x, bias, activation, p, seed) -> y`` = dropout(act(x + bias)). ``seed`` is an
  int64 CPU tensor ``[seed, offset]`` naming the counter-based (Philox) random stream: the mask is
  a pure function of (seed, offset, element index), identical on the CPU and the GPU, and the
  backward regenerates it instead of storing it. Backward: ``bias_act_dropout_backward``.
- ``glu(x, activation) -> y``: ``act(gate) * up`` for ``x = [gate | up]`` along the last dim
  (SwiGLU: silu, GEGLU: gelu); backward ``glu_backward``.
- ``cross_entropy(logits, target, ignore_index, label_smoothing, reduction, need_grad)
  -> (loss, dlogits)``: loss and gradient in one fused pass over the logits (the probabilities are
  never stored); the backward is ``dlogits`` times the incoming gradient.

All take float32/float16/bfloat16 on the CPU and CUDA; non-contiguous inputs are copied.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _native
from ._eager import eager
from ._ops import _activation, _check_tensors, _describe, _empty, _fail, _native_call, _where

# ----------------------------------------------------------------------------------------------
# softmax


def _softmax_run(x: Tensor, scale: float) -> Tensor:
    _check_tensors("ferrite.softmax", [("input", x)])
    y = x.new_empty(x.shape)
    if x.numel() > 0:
        dev, stream = _where(x)
        xc = x.contiguous()
        if xc.dim() == 0:
            xc, y1 = xc.view(1), y.view(1)
        else:
            y1 = y
        _native_call(_native.softmax_forward, xc, y1, float(scale), device=dev, stream=stream)
    return y


@torch.library.custom_op("ferrite::softmax", mutates_args=())
def _softmax(x: Tensor, scale: float) -> Tensor:
    return _softmax_run(x, scale)


@_softmax.register_fake
def _(x, scale):
    _check_tensors("ferrite.softmax", [("input", x)])
    return x.new_empty(x.shape)


@torch.library.custom_op("ferrite::softmax_backward", mutates_args=())
def _softmax_backward(grad: Tensor, y: Tensor, scale: float) -> Tensor:
    _check_tensors("ferrite.softmax_backward", [("grad", grad), ("output", y)])
    dx = y.new_empty(y.shape)
    if y.numel() > 0:
        dev, stream = _where(y)
        shape = list(y.shape) if y.dim() > 0 else [1]
        _native_call(
            _native.softmax_backward,
            grad.contiguous().view(shape),
            y.contiguous().view(shape),
            dx.view(shape),
            float(scale),
            device=dev,
            stream=stream,
        )
    return dx


@_softmax_backward.register_fake
def _(grad, y, scale):
    return y.new_empty(y.shape)


def _softmax_setup(ctx, inputs, output):
    ctx.scale = inputs[1]
    ctx.save_for_backward(output)


def _softmax_bwd(ctx, grad):
    (y,) = ctx.saved_tensors
    return eager.softmax_backward(grad, y, ctx.scale), None


_softmax.register_autograd(_softmax_bwd, setup_context=_softmax_setup)


def softmax(input: Tensor, dim: int = -1, scale: float = 1.0) -> Tensor:
    """``torch.softmax(scale * input, dim)``. The kernels reduce along the last dim; another
    ``dim`` is moved last (a copy) and back."""
    if not isinstance(input, Tensor):
        _fail("ferrite.softmax", "input", "a torch.Tensor", type(input).__name__)
    nd = max(input.dim(), 1)
    if not -nd <= dim < nd:
        _fail("ferrite.softmax", "dim", f"a dim in [{-nd}, {nd})", str(dim))
    d = dim % nd
    if input.dim() == 0 or d == input.dim() - 1:
        return eager.softmax(input, float(scale))
    moved = input.movedim(d, -1)
    return eager.softmax(moved, float(scale)).movedim(-1, d)


# ----------------------------------------------------------------------------------------------
# bias + activation + dropout


def _check_p(op: str, p: float) -> None:
    if not (0.0 <= p < 1.0):
        _fail(op, "p", "a drop probability in [0, 1)", repr(p))


def _check_seed(op: str, seed: Tensor) -> Tuple[int, int]:
    if not isinstance(seed, Tensor) or seed.dtype != torch.int64 or seed.shape != (2,) or seed.device.type != "cpu":
        got = _describe(seed) if isinstance(seed, Tensor) else type(seed).__name__
        _fail(op, "seed", "an int64 CPU tensor [seed, offset]", got)
    s, o = (int(v) for v in seed.tolist())
    if s < 0 or o < 0:
        _fail(op, "seed", "non-negative seed and offset", f"[{s}, {o}]")
    return s, o


def _check_bias_cols(op: str, x: Tensor, bias: Optional[Tensor]) -> None:
    if bias is None:
        return
    cols = x.shape[-1] if x.dim() > 0 else 1
    if bias.dim() != 1 or bias.shape[0] != cols:
        _fail(op, "bias", f"a 1-D tensor [{cols}] (input's last dim)", _describe(bias))


def _rows(t: Tensor):
    """A contiguous view with at least one dim."""
    t = t.contiguous()
    return t.view(1) if t.dim() == 0 else t


@torch.library.custom_op("ferrite::bias_act_dropout", mutates_args=())
def _bias_act_dropout(x: Tensor, bias: Optional[Tensor], activation: str, p: float, seed: Tensor) -> Tensor:
    op = "ferrite.bias_act_dropout"
    _check_tensors(op, [("input", x), ("bias", bias)])
    _check_bias_cols(op, x, bias)
    _check_p(op, p)
    s, o = _check_seed(op, seed)
    act = _activation(op, activation)
    y = x.new_empty(x.shape)
    if x.numel() > 0:
        dev, stream = _where(x)
        _native_call(
            _native.bias_act_dropout,
            _rows(x),
            y.view(1) if y.dim() == 0 else y,
            bias=None if bias is None else bias.contiguous(),
            activation=act,
            p=float(p),
            seed=s,
            offset=o,
            device=dev,
            stream=stream,
        )
    return y


@_bias_act_dropout.register_fake
def _(x, bias, activation, p, seed):
    op = "ferrite.bias_act_dropout"
    _check_tensors(op, [("input", x), ("bias", bias)])
    _check_bias_cols(op, x, bias)
    _check_p(op, p)
    _activation(op, activation)
    return x.new_empty(x.shape)


@torch.library.custom_op("ferrite::bias_act_dropout_backward", mutates_args=())
def _bias_act_dropout_backward(
    grad: Tensor, x: Tensor, bias: Optional[Tensor], activation: str, p: float, seed: Tensor, need_bias: bool
) -> Tuple[Tensor, Tensor]:
    op = "ferrite.bias_act_dropout_backward"
    _check_tensors(op, [("grad", grad), ("input", x), ("bias", bias)])
    s, o = _check_seed(op, seed)
    act = _activation(op, activation)
    dx = x.new_empty(x.shape)
    db = x.new_empty(bias.shape) if (need_bias and bias is not None) else None
    if x.numel() > 0:
        dev, stream = _where(x)
        _native_call(
            _native.bias_act_dropout_backward,
            _rows(grad),
            _rows(x),
            dx.view(1) if dx.dim() == 0 else dx,
            bias=None if bias is None else bias.contiguous(),
            dbias=db,
            activation=act,
            p=float(p),
            seed=s,
            offset=o,
            device=dev,
            stream=stream,
        )
    elif db is not None:
        db.zero_()
    return dx, (db if db is not None else _empty(x))


@_bias_act_dropout_backward.register_fake
def _(grad, x, bias, activation, p, seed, need_bias):
    _check_tensors("ferrite.bias_act_dropout_backward", [("grad", grad), ("input", x), ("bias", bias)])
    return x.new_empty(x.shape), (x.new_empty(bias.shape) if (need_bias and bias is not None) else _empty(x))


def _bad_setup(ctx, inputs, output):
    x, bias, activation, p, seed = inputs
    ctx.activation, ctx.p = activation, p
    ctx.save_for_backward(x, bias, seed)


def _bad_bwd(ctx, grad):
    x, bias, seed = ctx.saved_tensors
    need_b = bias is not None and ctx.needs_input_grad[1]
    dx, db = eager.bias_act_dropout_backward(grad, x, bias, ctx.activation, ctx.p, seed, need_b)
    return dx, (db if need_b else None), None, None, None


_bias_act_dropout.register_autograd(_bad_bwd, setup_context=_bad_setup)


def _seed_tensor(seed) -> Tensor:
    """[seed, offset] as an int64 CPU tensor: given (an int, or a (seed, offset) pair), or drawn
    from torch's default CPU generator (so ``torch.manual_seed`` makes it reproducible; under
    torch.compile the draw is part of the graph)."""
    if seed is None:
        return torch.randint(0, 2**62, (2,), dtype=torch.int64)
    if isinstance(seed, Tensor):
        return seed
    if isinstance(seed, int):
        return torch.tensor([seed, 0], dtype=torch.int64)
    return torch.tensor([int(seed[0]), int(seed[1])], dtype=torch.int64)


def bias_act_dropout(
    input: Tensor,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = None,
    p: float = 0.0,
    training: bool = True,
    seed=None,
) -> Tensor:
    """``dropout(act(input + bias), p)`` in one pass. ``activation``: None, ``"relu"``, ``"gelu"``,
    ``"gelu_tanh"``, ``"silu"``. ``seed``: None (drawn from torch's CPU generator), an int, a
    ``(seed, offset)`` pair or an int64 tensor ``[seed, offset]``; the same seed gives the same
    mask on the CPU and the GPU. Kept elements are scaled by ``1/(1-p)``, as torch."""
    act = _activation("ferrite.bias_act_dropout", activation)
    if not training:
        p = 0.0
    return eager.bias_act_dropout(input, bias, act, float(p), _seed_tensor(seed))


def dropout(input: Tensor, p: float = 0.5, training: bool = True, seed=None) -> Tensor:
    """``torch.nn.functional.dropout`` with ferrite's counter-based mask (see ``bias_act_dropout``)."""
    return bias_act_dropout(input, None, None, p, training, seed)


# ----------------------------------------------------------------------------------------------
# gated linear units


def _glu_check(op: str, x: Tensor):
    _check_tensors(op, [("input", x)])
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        _fail(op, "input", "a last dim of even size ([..., 2·n]: gate then up)", _describe(x))
    return list(x.shape[:-1]) + [x.shape[-1] // 2]


@torch.library.custom_op("ferrite::glu", mutates_args=())
def _glu(x: Tensor, activation: str) -> Tensor:
    op = "ferrite.glu"
    shape = _glu_check(op, x)
    act = _activation(op, activation)
    out = x.new_empty(shape)
    if out.numel() > 0:
        dev, stream = _where(x)
        _native_call(_native.glu_forward, x.contiguous(), out, activation=act, device=dev, stream=stream)
    return out


@_glu.register_fake
def _(x, activation):
    shape = _glu_check("ferrite.glu", x)
    _activation("ferrite.glu", activation)
    return x.new_empty(shape)


@torch.library.custom_op("ferrite::glu_backward", mutates_args=())
def _glu_backward(grad: Tensor, x: Tensor, activation: str) -> Tensor:
    op = "ferrite.glu_backward"
    _glu_check(op, x)
    _check_tensors(op, [("input", x), ("grad", grad)])
    act = _activation(op, activation)
    dx = x.new_empty(x.shape)
    if grad.numel() > 0:
        dev, stream = _where(x)
        _native_call(
            _native.glu_backward, grad.contiguous(), x.contiguous(), dx, activation=act, device=dev, stream=stream
        )
    else:
        dx.zero_()
    return dx


@_glu_backward.register_fake
def _(grad, x, activation):
    return x.new_empty(x.shape)


def _glu_setup(ctx, inputs, output):
    ctx.activation = inputs[1]
    ctx.save_for_backward(inputs[0])


def _glu_bwd(ctx, grad):
    (x,) = ctx.saved_tensors
    return eager.glu_backward(grad, x, ctx.activation), None


_glu.register_autograd(_glu_bwd, setup_context=_glu_setup)


def swiglu(input: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``input = cat([gate, up], -1)``."""
    return eager.glu(input, "silu")


def geglu(input: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(gate) * up`` for ``input = cat([gate, up], -1)`` (``approximate`` as in F.gelu)."""
    if approximate not in ("none", "tanh"):
        _fail("ferrite.geglu", "approximate", "'none' or 'tanh'", repr(approximate))
    return eager.glu(input, "gelu_tanh" if approximate == "tanh" else "gelu_erf")


# ----------------------------------------------------------------------------------------------
# cross-entropy

_REDUCTIONS = ("mean", "sum", "none")


def _ce_check(op: str, logits: Tensor, target: Tensor, reduction: str, label_smoothing: float):
    _check_tensors(op, [("input", logits)])
    if logits.dim() not in (1, 2):
        _fail(op, "input", "logits [N, C] or [C] (reshape higher-rank logits to [N, C])", _describe(logits))
    if not isinstance(target, Tensor) or target.dtype not in (torch.int64, torch.int32):
        got = _describe(target) if isinstance(target, Tensor) else type(target).__name__
        _fail(op, "target", "class indices (int64 or int32; probabilities are not supported)", got)
    rows = logits.shape[0] if logits.dim() == 2 else None
    want = [rows] if rows is not None else []
    if list(target.shape) != want:
        _fail(op, "target", f"shape {want} (one class index per row of input {list(logits.shape)})", _describe(target))
    if target.device != logits.device:
        _fail(op, "target", f"a tensor on {logits.device} (like `input`)", _describe(target))
    if logits.shape[-1] == 0 and target.numel() > 0:
        # No class for a target to name (torch raises too); N = 0 stays an empty loss.
        _fail(op, "input", "at least one class (C ≥ 1) when there are targets", _describe(logits))
    if reduction not in _REDUCTIONS:
        _fail(op, "reduction", "'mean', 'sum' or 'none'", repr(reduction))
    if not (0.0 <= label_smoothing < 1.0):
        _fail(op, "label_smoothing", "a value in [0, 1)", repr(label_smoothing))


def _ce_rows_kept(logits: Tensor) -> bool:
    """CUDA logits [N, V] in rows further apart than V (``ferrite.linear_rows``' padded output)
    are read as they are, and dlogits takes the same row stride."""
    return (
        logits.dim() == 2
        and logits.is_cuda
        and logits.shape[0] > 1
        and logits.stride(1) == 1
        and logits.stride(0) > logits.shape[1]
    )


@torch.library.custom_op("ferrite::cross_entropy", mutates_args=())
def _cross_entropy(
    logits: Tensor,
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    need_grad: bool,
    check_targets: bool = False,
    float_loss: bool = False,
) -> Tuple[Tensor, Tensor]:
    op = "ferrite.cross_entropy"
    _ce_check(op, logits, target, reduction, label_smoothing)
    squeeze = logits.dim() == 1
    if _ce_rows_kept(logits):
        lg = logits
    else:
        lg = logits.contiguous().view(1, -1) if squeeze else logits.contiguous()
        if lg.stride() != (lg.shape[1], 1):
            # torch calls a tensor with size-1 dims contiguous whatever their strides; the kernel
            # reads the row stride, and dlogits must share it: standard strides.
            lg = lg.new_empty(lg.shape).copy_(lg)
    tg = target.contiguous().view(1) if squeeze else target.contiguous()
    n = lg.shape[0]
    rows = logits.new_empty((n,), dtype=torch.float32)
    total = logits.new_empty((1,), dtype=torch.float32)
    grad = logits.new_empty_strided(lg.shape, lg.stride()) if need_grad else None
    if n > 0 and lg.shape[1] > 0:
        dev, stream = _where(logits)
        # On CUDA the target check reads a device flag back (a sync): only when asked for, and
        # never while a CUDA graph is being captured. Unchecked, a bad target's row loss is NaN.
        check = check_targets and not (logits.is_cuda and torch.cuda.is_current_stream_capturing())
        _native_call(
            _native.cross_entropy,
            lg,
            tg,
            rows,
            loss=total,
            grad=grad,
            ignore_index=int(ignore_index),
            label_smoothing=float(label_smoothing),
            reduction=reduction,
            dloss=1.0,
            check_targets=check,
            device=dev,
            stream=stream,
        )
    else:
        rows.zero_()
        total.fill_(float("nan") if reduction == "mean" else 0.0)
        if grad is not None:
            grad.zero_()
    if reduction == "none":
        loss = rows[0] if squeeze else rows
    else:
        loss = total[0]
    # An output of its own, not a view of `rows`; in the logits' dtype as torch's, or float32.
    loss = loss.to(torch.float32 if float_loss else logits.dtype, copy=True)
    if grad is None:
        return loss, _empty(logits)
    return loss, (grad.view(logits.shape) if squeeze else grad)


@_cross_entropy.register_fake
def _(logits, target, ignore_index, label_smoothing, reduction, need_grad, check_targets=False, float_loss=False):
    _ce_check("ferrite.cross_entropy", logits, target, reduction, label_smoothing)
    dt = torch.float32 if float_loss else logits.dtype
    if reduction == "none" and logits.dim() == 2:
        loss = logits.new_empty((logits.shape[0],), dtype=dt)
    else:
        loss = logits.new_empty((), dtype=dt)
    if not need_grad:
        return loss, _empty(logits)
    kept = _ce_rows_kept(logits)
    return loss, (logits.new_empty_strided(logits.shape, logits.stride()) if kept else logits.new_empty(logits.shape))


@torch.library.custom_op("ferrite::ce_scale_grad_", mutates_args=("grad",))
def _ce_scale_grad_(grad: Tensor, dloss: Tensor) -> None:
    if grad.numel() == 0:
        return
    dev, stream = _where(grad)
    g = grad if grad.dim() <= 2 else grad.view(-1, grad.shape[-1])
    _native_call(_native.cross_entropy_scale_grad, g, dloss.contiguous().view(-1), device=dev, stream=stream)


@_ce_scale_grad_.register_fake
def _(grad, dloss):
    return None


def _ce_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    ctx.need_grad = inputs[5]
    ctx.reduction = inputs[4]
    ctx.save_for_backward(output[1])


def _ce_bwd(ctx, grad_loss, _grad_dlogits):
    if grad_loss is None:  # only an output without a gradient was used
        return (None,) * 8
    if not ctx.need_grad:
        raise RuntimeError(
            "ferrite.cross_entropy: backward needs the gradient computed in the forward, which ran "
            "with need_grad=False"
        )
    if getattr(ctx, "grad_used", False):
        raise RuntimeError(
            "ferrite.cross_entropy: a second backward through the same loss (retain_graph=True) is "
            "not supported: the first one scaled the saved gradient in place"
        )
    ctx.grad_used = True
    (dlogits,) = ctx.saved_tensors
    g = grad_loss.to(dlogits.dtype)
    traced = (
        torch.compiler.is_compiling()
        or type(dlogits) is not Tensor
        or torch._C._len_torch_dispatch_stack() > 0
    )
    if traced:
        # Traced (torch.compile, AOT autograd, fake tensors): the functional multiply, which the
        # compiler fuses; a mutation of a saved forward output inside a traced backward is what
        # its partitioner cannot place, so the in-place fold is for eager mode only. The product
        # is written into a tensor with dlogits' own strides: for logits in padded rows
        # (`linear_rows`) a plain multiply would come out dense, and the classifier's backward
        # GEMMs would copy it back into padded rows — two extra passes over N·C elements. Written
        # this way inductor runs one multiply over dlogits' buffer, in place.
        if ctx.reduction == "none" and dlogits.dim() == 2:
            g = g.unsqueeze(-1)
        out = torch.empty_strided(dlogits.shape, dlogits.stride(), dtype=dlogits.dtype, device=dlogits.device)
        out.copy_(dlogits * g)
        return out, None, None, None, None, None, None, None
    # The forward's dlogits already hold the gradient for dloss = 1; the incoming dloss is folded
    # in place, on the device (dloss = 1, the usual `loss.backward()`, costs one tiny launch and
    # no pass over the logits). No second logits-sized buffer, no multiply by a broadcast.
    torch.ops.ferrite.ce_scale_grad_(dlogits, g)
    return dlogits, None, None, None, None, None, None, None


_cross_entropy.register_autograd(_ce_bwd, setup_context=_ce_setup)


def cross_entropy(
    input: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    check_targets: bool = False,
    float_loss: bool = False,
) -> Tensor:
    """``torch.nn.functional.cross_entropy`` for logits ``[N, C]`` (or ``[C]``) and class indices,
    fused: the loss and dlogits come from one kernel, the probabilities are never stored. The
    gradient is computed in the forward when one will be needed (and kept until the backward:
    ``N·C`` elements, like the logits).

    Targets outside ``[0, C)`` (other than ``ignore_index``): on the CPU always a ``ValueError``
    naming the row; on CUDA the row's loss is NaN (so is a mean), asynchronously — or, with
    ``check_targets=True``, the kernel's error flag is read back (a sync) and a ``ValueError``
    names the row. The loss is in the logits' dtype (as torch's), or float32 with
    ``float_loss=True`` (the kernel's own fp32 sum, as a language model's training loop reports it).
    The backward folds the incoming gradient into the saved dlogits in place (on the device; a
    gradient of 1 costs no pass over them): backward runs once per forward."""
    need = torch.is_grad_enabled() and input.requires_grad
    return eager.cross_entropy(
        input, target, int(ignore_index), float(label_smoothing), reduction, need, bool(check_targets), bool(float_loss)
    )[0]
