"""Ops that return buffers beside their result (cross_entropy's dlogits, mlp's hidden
activations, linear's pre-activation, the norms' statistics) must not make autograd fill a zero
gradient for each of them on every backward: at a language model's sizes that is a pass over GBs
(8192 × 128256 logits: 2 GB) that the step pays for nothing."""

import torch

import ferrite


def _fills(fn, *shapes):
    """The zero-fill ops the backward of fn() runs on tensors of the given shapes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    hits = []
    for e in prof.events():
        if e.name in ("aten::zeros_like", "aten::zeros", "aten::zero_", "aten::fill_", "aten::new_zeros"):
            if any(list(s) in [list(x) for x in shapes] for s in e.input_shapes if s):
                hits.append((e.name, e.input_shapes))
    return hits


def test_cross_entropy_backward_fills_no_dlogits_sized_zeros():
    logits = torch.randn(37, 1001, requires_grad=True)
    target = torch.randint(0, 1001, (37,))
    loss = ferrite.cross_entropy(logits, target)
    assert _fills(lambda: loss.backward(), (37, 1001)) == []
    ref = logits.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy(ref, target).backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_mlp_and_linear_backward_fill_no_hidden_sized_zeros():
    x = torch.randn(29, 24, requires_grad=True)
    w1, b1 = torch.randn(40, 24, requires_grad=True), torch.randn(40, requires_grad=True)
    w2, b2 = torch.randn(24, 40, requires_grad=True), torch.randn(24, requires_grad=True)
    y = ferrite.mlp(x, w1, b1, w2, b2, "gelu_tanh")
    assert _fills(lambda: y.sum().backward(), (29, 40)) == []
    z = ferrite.linear(x, w1, b1, activation="relu")
    assert _fills(lambda: z.sum().backward(), (29, 40)) == []
    assert torch.isfinite(x.grad).all()


def test_norms_backward_fill_no_statistics_sized_zeros_and_match_torch():
    x = torch.randn(33, 48, requires_grad=True)
    w = torch.randn(48, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    y = ferrite.layer_norm(x, [48], w, b)
    assert _fills(lambda: y.square().sum().backward(), (33,), (33, 1)) == []
    ref = x.detach().clone().requires_grad_()
    torch.nn.functional.layer_norm(ref, [48], w.detach(), b.detach()).square().sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-4, atol=1e-4)


def test_add_norm_with_only_the_residual_used():
    # The normed output unused: its gradient arrives as None and the residual's passes through.
    x = torch.randn(9, 16, requires_grad=True)
    r = torch.randn(9, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    y, h = ferrite.add_rms_norm(x, r, [16], w)
    (h * 3.0).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    torch.testing.assert_close(r.grad, torch.full_like(r, 3.0))
    assert w.grad is None or torch.count_nonzero(w.grad) == 0
