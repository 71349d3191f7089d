"""``ferrite.validate(reference, candidate, inputs)``: does a swapped module (or model) compute what
the original did? Runs both on the same inputs, compares the outputs and — with a backward of
the same random cotangent — the gradients of every parameter (matched by name) and of every
input that requires one, with tolerances for the dtype, and returns a readable report.

    ref = copy.deepcopy(model); ferrite.optimize(model)
    report = ferrite.validate(ref, model, (ids,))
    print(report); assert report.ok
"""

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

# Relative tolerance on max |a − b| / max |b| for each dtype: a bf16 result carries ~3 significant
# digits, and a composition of ops rounds more than once.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


@dataclasses.dataclass
class Check:
    name: str
    error: float
    tolerance: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


@dataclasses.dataclass
class Report:
    checks: List[Check]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def worst(self) -> Optional[Check]:
        return max(self.checks, key=lambda c: c.error / c.tolerance, default=None)

    def __str__(self) -> str:
        w = max([len(c.name) for c in self.checks] + [4])
        lines = [f"{'what':{w}s}  {'rel error':>10s}  {'tolerance':>10s}  ok"]
        for c in self.checks:
            err = "nan" if c.error != c.error else f"{c.error:.3e}"
            lines.append(f"{c.name:{w}s}  {err:>10s}  {c.tolerance:>10.1e}  {'yes' if c.ok else 'NO'}{'  ' + c.note if c.note else ''}")
        n_bad = sum(not c.ok for c in self.checks)
        lines.append(f"{len(self.checks)} compared, {n_bad} outside tolerance" + ("" if n_bad else ": equivalent"))
        return "\n".join(lines)


def _tensors(out: Any, prefix: str = "output") -> Dict[str, Tensor]:
    """The floating tensors of a module's output (tensor, tuple/list, dict, or a ModelOutput)."""
    if isinstance(out, Tensor):
        return {prefix: out} if out.is_floating_point() else {}
    if hasattr(out, "to_tuple") and hasattr(out, "keys"):
        out = {k: out[k] for k in out.keys()}
    found = {}
    if isinstance(out, dict):
        for k, v in out.items():
            found.update(_tensors(v, f"{prefix}.{k}"))
    elif isinstance(out, (list, tuple)):
        for i, v in enumerate(out):
            found.update(_tensors(v, f"{prefix}[{i}]"))
    return found


def _rel(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    if not torch.isfinite(a).all():
        # NaN/inf only where the reference has the same (so a NaN never passes on its own).
        same = torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a[torch.isinf(a)], b[torch.isinf(b)])
        if not same:
            return float("nan")
        m = torch.isfinite(b)
        a, b = a[m], b[m]
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def validate(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    inputs: Sequence[Any],
    kwargs: Optional[Dict[str, Any]] = None,
    *,
    grads: bool = True,
    seed: int = 0,
    tolerance: Optional[float] = None,
    loss: Optional[Callable[[Any], Tensor]] = None,
) -> Report:
    """Compares ``candidate(*inputs, **kwargs)`` against ``reference(...)``: every floating tensor
    of the outputs, then (``grads``) the gradients after a backward of ``loss(output)`` (default:
    Σ ⟨output tensor, a fixed random cotangent⟩) — each parameter's, matched by name, and each
    input's that requires one. ``tolerance`` overrides the per-dtype relative bound
    (``max |a − b| / max |b|``). Inputs are cloned per module, so in-place ops cannot leak."""
    kwargs = kwargs or {}
    checks: List[Check] = []

    def run(module):
        ins = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, Tensor) else t for t in inputs]
        module.zero_grad(set_to_none=True)
        out = module(*ins, **kwargs)
        return ins, out

    ins_r, out_r = run(reference)
    ins_c, out_c = run(candidate)
    tr, tc = _tensors(out_r), _tensors(out_c)
    for name in tr:
        tol = tolerance or TOLERANCE.get(tr[name].dtype, 1e-4)
        if name not in tc:
            checks.append(Check(name, float("inf"), tol, "missing from the candidate's output"))
            continue
        checks.append(Check(name, _rel(tc[name], tr[name]), tol))
    if grads:
        gen = torch.Generator().manual_seed(seed)

        def backward(out, tensors):
            if loss is not None:
                loss(out).backward()
                return
            total = None
            for k in sorted(tensors):
                t = tensors[k]
                if not t.requires_grad:
                    continue
                cot = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device, t.dtype)
                term = (t * cot).sum()
                total = term if total is None else total + term
            if total is not None:
                total.backward()

        backward(out_r, tr)
        gen.manual_seed(seed)
        backward(out_c, tc)
        pc = dict(candidate.named_parameters())
        for name, p in reference.named_parameters():
            if p.grad is None:
                continue
            tol = tolerance or TOLERANCE.get(p.grad.dtype, 1e-4)
            q = pc.get(name)
            if q is None or q.grad is None:
                checks.append(Check(f"grad {name}", float("inf"), tol, "no gradient in the candidate"))
            else:
                checks.append(Check(f"grad {name}", _rel(q.grad, p.grad), tol))
        for i, (a, b) in enumerate(zip(ins_c, ins_r)):
            if isinstance(b, Tensor) and b.grad is not None:
                tol = tolerance or TOLERANCE.get(b.grad.dtype, 1e-4)
                err = float("inf") if a.grad is None else _rel(a.grad, b.grad)
                checks.append(Check(f"grad input[{i}]", err, tol))
    return Report(checks)
