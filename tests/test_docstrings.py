"""help() on the public forward / step methods says what torch's generic text cannot."""
import clipshard
from clipshard.optim import AdamW


def test_clip_loss_forward_documents_scale_and_result_dtype():
    doc = clipshard.ClipLoss.forward.__doc__
    assert "already exponentiated" in doc and "0-dim fp32 tensor" in doc and "output_dict" in doc


def test_siglip_loss_forward_documents_scale_bias_and_result_dtype():
    doc = clipshard.SigLipLoss.forward.__doc__
    assert "already exponentiated" in doc and "logit_bias" in doc and "0-dim fp32 tensor" in doc
    assert "output_dict" in doc


def test_adamw_step_documents_rounding_and_closure():
    doc = AdamW.step.__doc__
    assert "stochastic rounding" in doc and "generator" in doc and "closure" in doc
