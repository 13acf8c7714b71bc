"""The fp64 references that replace torch's fp32 CPU kernels in bit-exact tests (so that the suite
passes on any x86-64 CPU) are themselves right: known answers, ties included."""
import pytest
import torch

from tests.references.rounding import round_to_nearest_reference

# (value, dtype, expected nearest, ties to even); the values are exact in fp64.
CASES = [
    (1 + 2**-11, torch.float16, 1.0),  # a tie between 1 and 1 + 2^-10: the even one
    (1 + 3 * 2**-11, torch.float16, 1 + 2**-9),  # a tie between 1 + 2^-10 (odd) and 1 + 2^-9 (even)
    (1 + 2**-11 + 2**-23, torch.float16, 1 + 2**-10),  # just above the tie
    (-(1 + 3 * 2**-11), torch.float16, -(1 + 2**-9)),  # the sign does not change the rule
    (2**-25 * 3, torch.float16, 2**-23),  # subnormal tie: 1.5 * 2^-24 -> 2 * 2^-24 (even)
    (2**-25, torch.float16, 0.0),  # half the smallest subnormal: a tie, to +0
    (1 + 2**-8, torch.bfloat16, 1.0),  # bf16 tie
    (1 + 3 * 2**-8, torch.bfloat16, 1 + 2**-6),
    (65504.0, torch.float16, 65504.0),  # representable values stay
]


@pytest.mark.parametrize("value, dtype, expected", CASES)
def test_round_to_nearest_reference_known_answers(value, dtype, expected):
    got = round_to_nearest_reference(torch.tensor([value], dtype=torch.float64), dtype)
    assert got.dtype == dtype and got.double().item() == expected
    assert str(got.double().item()) == str(expected)  # the sign of zero too
