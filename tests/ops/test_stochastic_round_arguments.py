"""Bad arguments of stochastic_round / stochastic_round_ raise a clear error naming the argument and
what was expected, never an error from deep inside torch, and never a silent reinterpretation
(bool('no') is True)."""
import pytest
import torch

from clipshard import stochastic_round, stochastic_round_


@pytest.mark.parametrize("saturate", ["no", 0, 1, None, torch.tensor(True)])
def test_saturate_must_be_a_bool(saturate):
    x = torch.ones(4)
    with pytest.raises(TypeError, match="stochastic_round: saturate must be True or False"):
        stochastic_round(x, saturate=saturate)
    with pytest.raises(TypeError, match="stochastic_round_: saturate must be True or False"):
        stochastic_round_(torch.empty(4, dtype=torch.float16), x, saturate=saturate)


@pytest.mark.parametrize("generator", [7, "cpu", torch.Generator().get_state()])
def test_generator_must_be_a_torch_generator(generator):
    with pytest.raises(TypeError, match="stochastic_round: generator must be a torch.Generator or None, got"):
        stochastic_round(torch.ones(4), generator=generator)
    with pytest.raises(TypeError, match="stochastic_round_: generator must be a torch.Generator or None"):
        stochastic_round_(torch.empty(4, dtype=torch.float16), torch.ones(4), generator=generator)


def test_generator_on_another_device_is_refused():
    from clipshard.ops.inputs import check_generator
    with pytest.raises(ValueError, match=r"f: generator must be on the tensors' device \(meta\), got a generator on cpu"):
        check_generator("f", torch.Generator(), torch.device("meta"))
    check_generator("f", torch.Generator(), torch.device("cpu"))  # the right device passes
