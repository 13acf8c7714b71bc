"""In-place writes are visible to autograd: stochastic_round_ and AdamW.step bump version counters,
so a graph that saved an overwritten tensor raises in backward exactly where torch's own copy_ and
torch.optim.AdamW raise; a leaf that requires grad is refused outside no_grad, as by copy_; and the
gradients of stochastic_round / stochastic_round_ are the identity (straight-through), as for a cast."""
import pytest
import torch

import clipshard
from clipshard import stochastic_round, stochastic_round_
from clipshard.optim import AdamW

HALF = (torch.float16, torch.bfloat16)
INPLACE_ERROR = "modified by an inplace operation"

# Graphs over a tensor w, and whether torch's autograd saves w itself for backward.
GRAPHS = {
    "w*w saves w": lambda w: (w * w).float().sum(),
    "w.sum() saves nothing": lambda w: w.float().sum(),
    "3*w saves nothing": lambda w: (3 * w).float().sum(),
    "w.exp() saves its result, not w": lambda w: w.exp().float().sum(),
}


def _explicit_values(n, dtype):
    """n distinct values, exactly representable in every dtype used here (multiples of 1/8)."""
    return ((torch.arange(n, dtype=torch.float64) - n / 2) / 8).to(dtype)


def _backward_outcome(build, overwrite, w):
    """Builds the graph on w, overwrites w, runs backward: "raises" or "ok"."""
    loss = build(w)
    overwrite()
    try:
        loss.backward()
    except RuntimeError as error:
        assert INPLACE_ERROR in str(error)
        return "raises"
    return "ok"


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("graph", GRAPHS)
def test_stochastic_round_into_a_saved_tensor_raises_where_copy_raises(graph, dtype):
    src = _explicit_values(16, torch.float32) + 1 / 3
    outcomes = []
    for write in (lambda w: w.copy_(src), lambda w: stochastic_round_(w, src, seed=1, offset=2)):
        w = _explicit_values(16, dtype).requires_grad_()

        def overwrite():
            with torch.no_grad():
                write(w)
        outcomes.append(_backward_outcome(GRAPHS[graph], overwrite, w))
    assert outcomes[0] == outcomes[1], f"torch.copy_: {outcomes[0]}, stochastic_round_: {outcomes[1]}"
    assert outcomes[0] == ("raises" if "saves w" in graph else "ok")  # the cases really differ


def test_stochastic_round_into_bumps_the_version_counter():
    dst = torch.zeros(5, dtype=torch.float16)
    for _ in range(2):
        before = dst._version
        stochastic_round_(dst, torch.ones(5), seed=0, offset=0)
        assert dst._version > before


@pytest.mark.parametrize("make_dst", [lambda w: w, lambda w: w[1:3]], ids=["leaf", "view of a leaf"])
def test_stochastic_round_into_a_leaf_that_requires_grad_is_refused_like_copy_(make_dst):
    w = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    src = torch.ones(make_dst(w.detach()).shape)
    with pytest.raises(RuntimeError) as theirs:
        make_dst(w).copy_(src)
    with pytest.raises(RuntimeError) as ours:
        stochastic_round_(make_dst(w), src, seed=0, offset=0)
    assert str(ours.value) == str(theirs.value)
    with torch.no_grad():  # allowed, as for copy_
        stochastic_round_(make_dst(w), src, seed=0, offset=0)
    assert w.detach().float()[: src.numel()].eq(1).any()


def test_stochastic_round_gradient_is_the_identity_like_a_cast():
    x = (_explicit_values(40, torch.float32) + 1 / 3).requires_grad_()
    upstream = _explicit_values(40, torch.float16) * 3  # exactly representable: no rounding anywhere
    for dtype in HALF:
        y = stochastic_round(x, dtype, seed=3, offset=4)
        assert y.requires_grad and y.grad_fn is not None
        (grad,) = torch.autograd.grad(y, x, upstream.to(dtype))
        (cast_grad,) = torch.autograd.grad(x.to(dtype), x, upstream.to(dtype))
        assert grad.dtype == torch.float32 and torch.equal(grad, cast_grad)


def test_stochastic_round_into_records_the_write_like_copy_():
    src = (_explicit_values(12, torch.float32) + 1 / 3).requires_grad_()
    upstream = _explicit_values(12, torch.float32)
    grads = []
    for write in (lambda d: d.copy_(src), lambda d: stochastic_round_(d, src, seed=5, offset=6)):
        dst = torch.zeros(12, dtype=torch.float16)
        out = write(dst)
        assert out is dst and dst.requires_grad
        grads.append(torch.autograd.grad(dst.float(), src, upstream)[0])
    assert torch.equal(grads[0], grads[1])
    # the values are the fused kernel's, whichever path wrote them
    dst = torch.zeros(12, dtype=torch.float16)
    stochastic_round_(dst, src, seed=5, offset=6)
    assert torch.equal(dst.detach(), stochastic_round(src.detach(), torch.float16, seed=5, offset=6))


@pytest.mark.parametrize("param_dtype", (torch.float32,) + HALF)
@pytest.mark.parametrize("graph", GRAPHS)
def test_adamw_step_on_a_saved_parameter_raises_where_torch_adamw_raises(graph, param_dtype):
    outcomes = []
    for make in (lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False), lambda ps: AdamW(ps, lr=0.1)):
        w = (_explicit_values(8, torch.float32) + 2).to(param_dtype).requires_grad_()
        opt = make([w])
        w.grad = torch.ones_like(w)
        outcomes.append(_backward_outcome(GRAPHS[graph], opt.step, w))
    assert outcomes[0] == outcomes[1], f"torch.optim.AdamW: {outcomes[0]}, clipshard: {outcomes[1]}"
    assert outcomes[0] == ("raises" if "saves w" in graph else "ok")


@pytest.mark.parametrize("state_dtype", (torch.float32,) + HALF)
def test_adamw_step_bumps_parameters_and_moments(state_dtype):
    w = torch.ones(6, dtype=torch.bfloat16, requires_grad=True)
    opt = AdamW([w], lr=0.1, state_dtype=state_dtype)
    w.grad = torch.ones_like(w)
    version = w._version
    opt.step()  # creates the moments
    assert w._version > version
    tensors = [w] + [t for key, t in opt.state[w].items() if key != "step"]
    assert len(tensors) == 3
    before = [t._version for t in tensors]
    opt.step()
    assert all(t._version > v for t, v in zip(tensors, before))


def test_to_half_precision_invalidates_graphs_that_saved_the_fp32_weight():
    w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 64))
    loss = (w * w).sum()  # saves w
    clipshard.optim.to_half_precision_(w, torch.bfloat16)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
