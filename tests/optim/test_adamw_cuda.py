"""clipshard.optim.AdamW on CUDA: the multi-tensor kernel against the CPU kernel (bitwise, same
seed and offset, tensor numbers and index bases, NaN and Inf included), against torch.optim.AdamW
in fp32, and reproducibility. Skipped without a GPU."""
import pytest
import torch

import clipshard  # noqa: F401
from clipshard.optim import AdamW

pytestmark = pytest.mark.cuda
HALF = (torch.float16, torch.bfloat16)


def _odd_sizes(count, gen):
    """`count` odd sizes from 1 to 200k elements, some larger than one CUDA chunk (65536)."""
    sizes = [int(s) for s in torch.randint(1, 3000, (count,), generator=gen)]
    sizes[::7] = [65536 + 1, 131071, 4099, 1, 3, 200_001, 5][: len(sizes[::7])]
    return sizes


def _random(n, dtype, gen, positive=False):
    """Random values at a random magnitude (never zeros)."""
    values = torch.randn(n, generator=gen) * 10 ** float(torch.randint(-4, 3, (1,), generator=gen))
    return (values.abs() + 1e-30 if positive else values).to(dtype)


def _place(t, device, misaligned):
    """A copy of t on `device`; with `misaligned`, a contiguous view starting one element into its
    buffer, so the kernel cannot use vector loads and stores."""
    if not misaligned:
        return t.to(device, copy=True)
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
    buffer[1:].copy_(t)
    return buffer[1:]


@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("param_dtype,state_dtype", [
    (p, s) for p in (torch.float32,) + HALF for s in (torch.float32,) + HALF])
def test_cuda_step_equals_cpu_step_bitwise(param_dtype, state_dtype, stochastic, misaligned):
    gen = torch.Generator().manual_seed(0)
    count = 45  # more than one kernel launch's tensor table
    sizes = _odd_sizes(count, gen)
    params = [_random(n, param_dtype, gen) for n in sizes]
    grads = [_random(n, param_dtype, gen) for n in sizes]
    exp_avgs = [_random(n, state_dtype, gen) for n in sizes]
    exp_avg_sqs = [_random(n, state_dtype, gen, positive=True) for n in sizes]
    steps = [int(s) for s in torch.randint(1, 1000, (count,), generator=gen)]
    # shards of larger parameters: tensor numbers out of order, index bases of every residue mod 4
    numbers = torch.randperm(3 * count, generator=gen)[:count].tolist()
    bases = [int(b) for b in torch.randint(0, 1 << 30, (count,), generator=gen)]
    cpu = [[_place(t, "cpu", misaligned) for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs)]
    cuda = [[_place(t, "cuda", misaligned) for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs)]
    args = (1e-3, 0.9, 0.999, 1e-8, 0.01, False, stochastic, 0x1234_5678_9ABC, -77, numbers, bases)
    torch.ops.clipshard.adamw_step_(*cpu, steps, *args)
    torch.ops.clipshard.adamw_step_(*cuda, steps, *args)
    torch.cuda.synchronize()
    for role, (on_cpu, on_cuda) in enumerate(zip(cpu, cuda)):
        for i, (a, b) in enumerate(zip(on_cpu, on_cuda)):
            bits = torch.int32 if a.dtype == torch.float32 else torch.int16
            assert torch.equal(a.view(bits), b.cpu().view(bits)), f"role {role}, tensor {i} ({a.numel()} elements)"


@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("param_dtype,state_dtype", [
    (p, s) for p in (torch.float32,) + HALF for s in (torch.float32,) + HALF])
def test_cuda_nan_and_inf_give_the_cpu_bits_and_the_canonical_nan(param_dtype, state_dtype, stochastic):
    """The CPU test's NaN / Inf weights and gradients (tests/optim/test_adamw_shards.py): CUDA writes the
    same bits, every NaN the canonical one (NVIDIA's arithmetic NaN is 0x7FFFFFFF)."""
    from tests.optim.test_adamw_shards import ARGS, CANONICAL_NAN, _bits, _special_inputs
    p, g, m, v, _ = _special_inputs(param_dtype, state_dtype)
    cpu = [[t.clone()] for t in (p, g, m, v)]
    cuda = [[t.cuda()] for t in (p, g, m, v)]
    for tensors in (cpu, cuda):
        torch.ops.clipshard.adamw_step_(*tensors, [3], *ARGS, stochastic, 1, 2)
    torch.cuda.synchronize()
    for role, (a, b) in enumerate(zip(cpu, cuda)):
        assert torch.equal(_bits(a[0]), _bits(b[0].cpu())), role
        if role != 1:  # (the gradient is read only)
            nan_bits = _bits(b[0].cpu())[torch.isnan(b[0].cpu())]
            assert nan_bits.numel() > 0 and (nan_bits == CANONICAL_NAN[b[0].dtype]).all(), role


def test_cuda_fp32_matches_torch_fused_adamw():
    gen = torch.Generator().manual_seed(1)
    ours = [torch.randn(n, generator=gen).cuda().requires_grad_() for n in (7, 1000, 70001)]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    opt = AdamW(ours, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(30):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen).cuda()
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_cuda_bf16_training_is_reproducible_and_uses_the_cuda_generator():
    def run(seed):
        torch.manual_seed(seed)
        params = [torch.ones(1000, 33, device="cuda", dtype=torch.bfloat16, requires_grad=True)]
        opt = AdamW(params, lr=1e-3)
        for _ in range(5):
            params[0].grad = torch.full_like(params[0], 0.1)
            opt.step()
        return params[0].detach().clone()

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert 0.05 < (a != 1).float().mean() < 0.95  # sub-ulp updates moved some weights, not all
