"""Bad arguments of clip_loss / ClipLoss / contrastive_lse raise a clear error naming the argument and
what was expected, never an error from deep inside torch, and never a silent reinterpretation
(bool('no') is True)."""
import pytest
import torch

import clipshard


def _pair():
    return torch.ones(4, 3), torch.ones(4, 3)


@pytest.mark.parametrize("name", ["local_loss", "gather_with_grad"])
def test_loss_flags_must_be_bools(name):
    with pytest.raises(TypeError, match=f"clip_loss: {name} must be True or False, got 'no'"):
        clipshard.clip_loss(*_pair(), 10.0, **{name: "no"})
    with pytest.raises(TypeError, match=f"ClipLoss: {name} must be True or False, got 0"):
        clipshard.ClipLoss(**{name: 0})


def test_clip_loss_module_arguments():
    with pytest.raises(TypeError, match="ClipLoss: cache_labels must be True or False"):
        clipshard.ClipLoss(cache_labels="yes")
    with pytest.raises(TypeError, match=r"ClipLoss: rank must be an int, got '0' \(str\)"):
        clipshard.ClipLoss(rank="0")
    with pytest.raises(ValueError, match="ClipLoss: world_size must be >= 1, got 0"):
        clipshard.ClipLoss(world_size=0)
    with pytest.raises(TypeError, match="ClipLoss: output_dict must be True or False"):
        clipshard.ClipLoss()(*_pair(), 10.0, output_dict="yes")


def test_contrastive_lse_flags_must_be_bools():
    with pytest.raises(TypeError, match="contrastive_lse: want_col_lse must be True or False, got 'no'"):
        clipshard.contrastive_lse(*_pair(), 10.0, want_col_lse="no")


def test_contrastive_lse_has_no_deterministic_flag():
    """Every path is deterministic: the flag that no path used is gone."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'deterministic'"):
        clipshard.contrastive_lse(*_pair(), 10.0, deterministic=True)
