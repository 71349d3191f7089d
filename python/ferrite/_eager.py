"""The eager fast path: ``eager.<name>(...)`` calls ferrite's custom op ``torch.ops.ferrite.<name>``
without the dispatcher when nothing but plain eager PyTorch is running.

A call through ``torch.ops`` costs ~100 µs of host time before the op's own Python body runs
(dispatcher, the generated autograd Function that redispatches below autograd, argument
normalisation) — more than the kernel at the sizes a transformer's small ops run at. In plain
eager mode none of that machinery changes the result, so the fast path calls the same Python body
(the op's implementation) directly, wrapped in an ``autograd.Function`` built from the same
``setup_context`` and backward as the registered autograd when a gradient is needed. Results,
saved tensors and gradients are those of the custom op.

The dispatcher path is kept whenever anything could see the difference: ``torch.compile`` /
dynamo tracing, any ``__torch_dispatch__`` or ``__torch_function__`` mode (fake tensors,
``make_fx``, opcheck, FlopCounter, ``with torch.device(...)``), functorch transforms (vmap,
grad), a tensor argument that is not a plain ``torch.Tensor`` / ``Parameter`` (FakeTensor,
DTensor, other subclasses), keyword arguments or omitted defaults, ops that mutate their
arguments, and ops without a registered autograd when a gradient would be needed (the
dispatcher's error then stays). ``FERRITE_EAGER_FAST=0`` turns the fast path off.
"""

import os
from typing import Any, Callable, Optional

import torch
from torch import Tensor

_ENABLED = os.environ.get("FERRITE_EAGER_FAST", "1") != "0"
_PLAIN = (Tensor, torch.nn.Parameter)


def _opdef(qualname: str):
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # the registry moved: the dispatcher path only
        return None
    return OPDEFS.get(qualname)


def _functorch_active() -> bool:
    f = getattr(torch._C, "_functorch", None)
    level = getattr(f, "maybe_current_level", None) if f is not None else None
    return level is not None and level() is not None


def _scan(args):
    """(plain eager PyTorch alone will see this call, a gradient is needed), in one pass over the
    arguments."""
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False, False
    grad_on = torch.is_grad_enabled()
    needs = False
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, Tensor):
                if type(t) not in _PLAIN:
                    return False, False
                needs = needs or (grad_on and t.requires_grad)
    if _functorch_active():
        return False, False
    return True, needs


class _Op:
    """One op: the dispatcher callable plus, when the op allows it, the direct path."""

    __slots__ = ("op", "fn", "nargs", "function")

    def __init__(self, name: str):
        self.op = getattr(torch.ops.ferrite, name)
        self.fn: Optional[Callable[..., Any]] = None
        self.function = None
        d = _opdef(f"ferrite::{name}")
        fn = getattr(d, "_init_fn", None) if d is not None else None
        schema = getattr(getattr(d, "_opoverload", None), "_schema", None)
        if not _ENABLED or fn is None or schema is None:
            return
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return  # mutating ops keep the dispatcher (functionalisation, version counters)
        self.fn = fn
        self.nargs = len(schema.arguments)
        setup = getattr(d, "_setup_context_fn", None)
        bwd = getattr(d, "_backward_fn", None)
        if setup is not None and bwd is not None:
            self.function = _function(name, fn, setup, bwd)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.op(*args, **kwargs)
        if self.fn is None or kwargs or len(args) != self.nargs:
            return self.op(*args, **kwargs)
        plain, needs_grad = _scan(args)
        if not plain:
            return self.op(*args)
        if needs_grad:
            if self.function is None:
                return self.op(*args)
            return self.function.apply(*args)
        return self.fn(*args)


def _function(name: str, fn, setup, bwd):
    """An autograd.Function running ``fn`` with the op's registered setup_context and backward
    (as torch's generated one does: setup inside forward, gradients materialised)."""

    def forward(ctx, *args):
        out = fn(*args)
        setup(ctx=ctx, inputs=args, output=out)
        # A List[Tensor] op: autograd tracks tuples, and the op's backward takes the list of
        # gradients as one argument (as the dispatcher's generated Function passes it).
        ctx.listed = isinstance(out, list)
        return tuple(out) if ctx.listed else out

    def backward(ctx, *grads):
        if ctx.listed:
            return bwd(ctx, list(grads))
        return bwd(ctx, *grads)

    return type(
        f"FerriteEager_{name}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


class _Namespace:
    def __getattr__(self, name: str) -> _Op:
        if name.startswith("__"):
            raise AttributeError(name)
        if torch.compiler.is_compiling():
            # First use inside a trace: the op itself (building the _Op is not traceable).
            return getattr(torch.ops.ferrite, name)
        op = _Op(name)
        setattr(self, name, op)
        return op


eager = _Namespace()
