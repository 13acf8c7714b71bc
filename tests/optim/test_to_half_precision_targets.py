"""to_half_precision_ on what it may be given besides one module: Parameters, and lists mixing
modules and Parameters (as open_clip's CLIP keeps its text tower)."""
import pytest
import torch

from clipshard.optim import to_half_precision_


def _parts(seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(9, 5)
    return layer, torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))


def test_parameters_and_modules_in_one_list_are_converted_the_same_as_one_by_one():
    layer, projection, other = _parts()
    targets = [layer, projection]
    assert to_half_precision_(targets, generator=torch.Generator().manual_seed(3)) is targets
    assert {p.dtype for p in (layer.weight, layer.bias, projection)} == {torch.bfloat16}
    assert other.dtype == torch.float32  # not listed, not converted
    ref_layer, ref_projection, _ = _parts()
    gen = torch.Generator().manual_seed(3)
    to_half_precision_(ref_layer, generator=gen)
    to_half_precision_(ref_projection, generator=gen)
    assert torch.equal(layer.weight, ref_layer.weight) and torch.equal(projection, ref_projection)


def test_wrong_targets_are_refused_before_anything_is_converted():
    layer, projection, _ = _parts()
    with pytest.raises(TypeError, match="to_half_precision_: expected modules or Parameters .* got Tensor at position 1"):
        to_half_precision_([layer, torch.zeros(3)])
    assert layer.weight.dtype == torch.float32
    with pytest.raises(TypeError, match=r"to_half_precision_: parameter '#1 \(shape \(5, 3\)\)' is torch.float64"):
        to_half_precision_([layer, torch.nn.Parameter(projection.double())])
    assert layer.weight.dtype == torch.float32
