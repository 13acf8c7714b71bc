"""clipshard::adamw_step_'s placement in the random streams (tensor_numbers, index_bases): a shard
updated on its own draws exactly the bits of the unsharded tensor, whatever its offset (multiples
of 4 or not, across the CPU kernel's blocks and chunks); and the canonical NaN that every AdamW
output and every rounding writes (docs/optimizer.md, docs/stochastic_rounding.md)."""
import pytest
import torch

import clipshard  # noqa: F401
from tests.references.adamw import adamw_step_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ARGS = (1e-2, 0.9, 0.99, 1e-8, 0.1, False)  # lr, beta1, beta2, eps, weight_decay, maximize
CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _tensors(n, param_dtype, state_dtype, gen):
    """p, g, m, v with realistic, varied magnitudes (never zeros)."""
    p = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 2, (n,), generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-2 + 1e-8
    if state_dtype == torch.float16:
        v = v.sqrt().sqrt()  # fp16 second moments are stored as v^(1/4)
    return p.to(param_dtype), g.to(param_dtype), m.to(state_dtype), v.to(state_dtype)


@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("param_dtype,state_dtype", [(p, s) for p in DTYPES for s in DTYPES])
def test_shards_draw_the_bits_of_the_full_tensor(param_dtype, state_dtype, stochastic):
    """A 40001-element tensor (more than two of the CPU kernel's 16384-element work items) updated
    whole, then as shards starting at offsets that are and are not multiples of 4, an empty shard
    and a 1-element shard included, each with the full tensor's number and its offset as index base."""
    gen = torch.Generator().manual_seed(3)
    n, number = 40001, 7
    full = _tensors(n, param_dtype, state_dtype, gen)
    sharded = [t.clone() for t in full]
    torch.ops.clipshard.adamw_step_(*[[t] for t in full], [5], *ARGS, stochastic, 11, 12, [number], [0])
    cuts = [0, 3, 3, 4, 16385, 16386, 20001, 32771, n]
    for begin, end in zip(cuts[:-1], cuts[1:]):
        shard = [t[begin:end] for t in sharded]
        torch.ops.clipshard.adamw_step_(*[[t] for t in shard], [5], *ARGS, stochastic, 11, 12, [number], [begin])
    for role, (a, b) in enumerate(zip(full, sharded)):
        if role != 1:  # (the gradient is read only)
            assert torch.equal(_bits(a), _bits(b)), f"role {role}"


def test_tensor_numbers_pick_the_streams():
    """A tensor given number k draws what it draws as the k-th tensor of a call without numbers;
    other numbers and other index bases draw other bits."""
    gen = torch.Generator().manual_seed(4)
    tensors = [_tensors(1000, torch.bfloat16, torch.bfloat16, gen) for _ in range(3)]

    def run(ts, numbers=None, bases=None):
        ts = [[t.clone() for t in x] for x in ts]
        ps, gs, ms, vs = (list(x) for x in zip(*ts))
        torch.ops.clipshard.adamw_step_(ps, gs, ms, vs, [2] * len(ps), *ARGS, True, 5, 6, numbers, bases)
        return ps

    together = run(tensors)
    assert torch.equal(run(tensors[2:], [2])[0], together[2])
    assert not torch.equal(run(tensors[2:], [1])[0], together[2])
    assert not torch.equal(run(tensors[2:], [2], [4])[0], together[2])


def test_placement_arguments_are_checked():
    p, g, m, v = ([torch.ones(8)] for _ in range(4))
    step = torch.ops.clipshard.adamw_step_
    with pytest.raises(RuntimeError, match="adamw_step_: tensor_numbers must have one entry per tensor"):
        step(p, g, m, v, [1], *ARGS, True, 0, 0, [0, 1], None)
    with pytest.raises(RuntimeError, match="adamw_step_: index_bases must have one entry per tensor"):
        step(p, g, m, v, [1], *ARGS, True, 0, 0, None, [])
    with pytest.raises(RuntimeError, match="adamw_step_: tensor_numbers must be distinct"):
        step(p * 2, g * 2, m * 2, v * 2, [1, 1], *ARGS, True, 0, 0, [3, 3], None)
    with pytest.raises(RuntimeError, match=r"adamw_step_: tensor_numbers\[0\] must be in \[0, 5592405\)"):
        step(p, g, m, v, [1], *ARGS, True, 0, 0, [-1], None)
    with pytest.raises(RuntimeError, match=r"adamw_step_: index_bases\[0\] must be >= 0"):
        step(p, g, m, v, [1], *ARGS, True, 0, 0, None, [-4])
    with pytest.raises(RuntimeError, match=r"adamw_step_: index_bases\[0\] must be >= 0 with .* \+ numel < 2\^42"):
        step(p, g, m, v, [1], *ARGS, True, 0, 0, None, [(1 << 42) - 8])


# --- the canonical NaN ------------------------------------------------------------------------------

def _special_inputs(param_dtype, state_dtype):
    """Weights and gradients with NaNs of either sign and with payloads, infinities and finite
    values, in every combination; finite moments."""
    f32 = torch.tensor([0x7FC00000, 0xFFC00000, 0x7FA00000, 0xFFFFFFFF, 0x7F800000, 0xFF800000,
                        0x3F800000, 0xC0200000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    p = f32.repeat_interleave(len(f32))
    g = f32.repeat(len(f32))
    n = p.numel()
    m = torch.full((n,), 1e-3)
    v = torch.full((n,), 1e-4)
    v_stored = v.sqrt().sqrt() if state_dtype == torch.float16 else v
    return p.to(param_dtype), g.to(param_dtype), m.to(state_dtype), v_stored.to(state_dtype), v


@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("param_dtype,state_dtype", [(p, s) for p in DTYPES for s in DTYPES])
def test_nan_and_inf_weights_and_gradients_give_the_canonical_nan(param_dtype, state_dtype, stochastic):
    """Every NaN AdamW writes is the positive quiet NaN with an empty payload (fp32 0x7FC00000, fp16
    0x7E00, bf16 0x7FC0), whatever NaN the arithmetic produced (x86: 0xFFC00000); NaN and Inf occur
    exactly where the fp64 step has them, and the infinities keep their sign."""
    p, g, m, v, v_decoded = _special_inputs(param_dtype, state_dtype)
    exact = adamw_step_reference(p, g, m, v_decoded, 3, *ARGS)
    torch.ops.clipshard.adamw_step_([p], [g], [m], [v], [3], *ARGS, stochastic, 1, 2)
    stored_v = v.double() ** 4 if state_dtype == torch.float16 else v.double()
    for name, got, stored, want in (("param", p, p.double(), exact[0]), ("exp_avg", m, m.double(), exact[1]),
                                    ("exp_avg_sq", v, stored_v, exact[2])):
        assert torch.equal(torch.isnan(stored), torch.isnan(want)), name
        assert torch.isnan(want).any(), name  # the test reaches NaNs in every output
        assert (_bits(got)[torch.isnan(stored)] == CANONICAL_NAN[got.dtype]).all(), name
        inf = torch.isinf(want)
        assert torch.equal(torch.isinf(stored), inf) and torch.equal(stored[inf], want[inf]), name
