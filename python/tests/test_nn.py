"""ferrite.nn drop-ins and ferrite.optimize()."""

import copy

import torch
import torch.nn.functional as F

import ferrite
import ferrite.nn as fnn
from helpers import close


class Custom(torch.nn.Linear):
    """A user's Linear subclass: optimize() must leave it alone."""

    def forward(self, x):
        return super().forward(x) * 2


class Model(torch.nn.Module):
    def __init__(self, d=24):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, 4, batch_first=True)
        self.norm2 = torch.nn.RMSNorm(d, eps=1e-6)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d, bias=False))
        self.head = Custom(d, 5)
        self.conv = torch.nn.Conv1d(d, d, 1)
        self.plain_ln = torch.nn.LayerNorm([6, d], elementwise_affine=False)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.head(self.plain_ln(x))


def test_optimize_swaps_in_place_and_matches():
    m = Model().eval()
    x = torch.randn(3, 6, 24)
    ref = m(x)
    before = {n: p for n, p in m.named_parameters()}
    keys = list(m.state_dict().keys())
    mods = dict(m.named_modules())
    swapped = ferrite.optimize(m)
    assert [s[0] for s in swapped] == ["norm1", "attn", "norm2", "mlp.0", "mlp.2", "plain_ln"]
    assert swapped[0] == ("norm1", "torch.nn.modules.normalization.LayerNorm", "ferrite.nn.LayerNorm")
    assert isinstance(m.norm1, fnn.LayerNorm) and isinstance(m.norm2, fnn.RMSNorm)
    assert isinstance(m.mlp[0], fnn.Linear) and isinstance(m.mlp[2], fnn.Linear)
    assert isinstance(m.attn, fnn.MultiheadAttention)
    # untouched: subclasses, attention's out_proj, other module types
    assert type(m.head) is Custom
    assert type(m.attn.out_proj) is torch.nn.modules.linear.NonDynamicallyQuantizableLinear
    assert type(m.conv) is torch.nn.Conv1d
    # same objects, same parameters, same state_dict
    assert all(mods[n] is mod for n, mod in m.named_modules())
    assert all(before[n] is p for n, p in m.named_parameters())
    assert list(m.state_dict().keys()) == keys
    close(m(x), ref, scale=10)
    assert ferrite.optimize(m) == []  # idempotent: nothing left to swap


def test_optimize_training_gradients_match():
    m = Model()
    m2 = copy.deepcopy(m)
    ferrite.optimize(m2, linear=True, norms=True)
    x = torch.randn(2, 6, 24)
    m(x).square().sum().backward()
    m2(x).square().sum().backward()
    for (n, p), (_, p2) in zip(m.named_parameters(), m2.named_parameters()):
        close(p2.grad, p.grad, scale=20)


def test_optimize_selection():
    m = Model()
    got = ferrite.optimize(m, linear=False)
    assert [s[0] for s in got] == ["norm1", "attn", "norm2", "plain_ln"]
    assert type(m.mlp[0]) is torch.nn.Linear
    m = Model()
    assert [s[0] for s in ferrite.optimize(m, norms=False)] == ["attn", "mlp.0", "mlp.2"]
    m = Model()
    assert [s[0] for s in ferrite.optimize(m, linear=False, norms=False)] == ["attn"]
    m = Model()
    assert [s[0] for s in ferrite.optimize(m, attention=False)] == ["norm1", "norm2", "mlp.0", "mlp.2", "plain_ln"]
    lin = torch.nn.Linear(3, 4)
    assert ferrite.optimize(lin) == [("", "torch.nn.modules.linear.Linear", "ferrite.nn.Linear")]


def test_dropins_construct_like_torch():
    torch.manual_seed(1)
    a = fnn.Linear(8, 3)
    torch.manual_seed(1)
    b = torch.nn.Linear(8, 3)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    x = torch.randn(5, 8)
    close(a(x), b(x))
    ln, rms = fnn.LayerNorm(8), fnn.RMSNorm(8)
    close(ln(x), F.layer_norm(x, [8]))
    close(rms(x), F.rms_norm(x, [8]))


def test_dropins_fall_back_where_ferrite_cannot_run():
    """float64 runs torch's implementation: a swapped model runs wherever the original did."""
    lin = fnn.Linear(8, 3).double()
    x = torch.randn(5, 8, dtype=torch.float64)
    close(lin(x).float(), F.linear(x, lin.weight, lin.bias).float())
    lin16 = fnn.Linear(8, 3).bfloat16()  # the CPU linear runs 16-bit (widened to f32 inside)
    xb = torch.randn(5, 8, dtype=torch.bfloat16)
    assert lin16(xb).dtype == torch.bfloat16
    close(lin16(xb), F.linear(xb.double(), lin16.weight.double(), lin16.bias.double()).bfloat16())
    rms = fnn.RMSNorm(8).bfloat16()  # norms do run 16-bit on the CPU
    close(rms(xb), F.rms_norm(xb, [8], rms.weight, None))
