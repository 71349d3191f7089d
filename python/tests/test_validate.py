"""ferrite.validate: equivalent modules pass, a perturbed weight, a wrong gradient and a NaN fail."""

import copy

import torch

import ferrite


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.fc = torch.nn.Linear(32, 48)

    def forward(self, x):
        return {"y": self.fc(self.norm(x)), "n": torch.tensor(3)}


def test_a_swapped_block_validates_and_a_perturbed_one_does_not():
    torch.manual_seed(0)
    ref = Block()
    cand = copy.deepcopy(ref)
    assert len(ferrite.optimize(cand)) == 2
    x = torch.randn(5, 7, 32, requires_grad=True)
    r = ferrite.validate(ref, cand, (x,))
    assert r.ok, str(r)
    names = [c.name for c in r.checks]
    assert "output.y" in names and "grad fc.weight" in names and "grad input[0]" in names
    with torch.no_grad():
        cand.fc.weight[3, 4] += 0.5
    r = ferrite.validate(ref, cand, (x,))
    assert not r.ok and not r.worst().ok and "NO" in str(r)


class GradOnly(torch.nn.Module):
    """Same forward as Linear, wrong backward (the gradient of the weight doubled)."""

    def __init__(self, lin):
        super().__init__()
        self.fc = lin

    def forward(self, x):
        w = self.fc.weight
        w2 = w + (w - w.detach())  # value w, gradient 2×
        return x @ w2.t() + self.fc.bias


def test_a_wrong_gradient_and_a_nan_are_caught():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    ref = torch.nn.Sequential()
    ref.fc = copy.deepcopy(lin)
    cand = GradOnly(copy.deepcopy(lin))
    x = torch.randn(3, 8)
    r = ferrite.validate(ref, cand, (x,))
    bad = {c.name for c in r.checks if not c.ok}
    assert bad == {"grad fc.weight"}, str(r)
    x_nan = x.clone()
    x_nan[1, 2] = float("nan")
    cand2 = copy.deepcopy(ref)
    r = ferrite.validate(ref, cand2, (x_nan,))
    assert r.ok, str(r)  # NaN in the same places as the reference: equivalent
    class Nan(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = copy.deepcopy(lin)

        def forward(self, x):
            y = self.fc(x)
            return y * torch.where(torch.arange(4) == 1, float("nan"), 1.0)
    r = ferrite.validate(ref, Nan(), (x,), grads=False)
    assert not r.ok
