"""Pure-PyTorch references, computed in fp64 and materialising everything. Used by the tests and
the benchmarks as the ground truth; never used in training."""
import torch


def similarity_reference(rows, cols, scale, bias=None):
    """S = scale * rows @ cols^T (+ bias), in fp64."""
    logits = scale.double() * rows.double() @ cols.double().T
    return logits if bias is None else logits + bias.double()


def contrastive_lse_reference(rows, cols, scale, bias=None, pos_offset=0, want_col_lse=True):
    """Same outputs as torch.ops.clipshard.contrastive_lse_forward (row LSE, positive logits,
    column LSE over these rows), differentiable through autograd, fp64."""
    logits = similarity_reference(rows, cols, scale, bias)
    index = torch.arange(rows.shape[0], device=rows.device)
    row_lse = torch.logsumexp(logits, dim=1)
    pos_logit = logits[index, pos_offset + index]
    col_lse = torch.logsumexp(logits, dim=0) if want_col_lse else logits.new_empty(0)
    return row_lse, pos_logit, col_lse


def clip_loss_reference(image_features, text_features, logit_scale, logit_bias=None):
    """open_clip's single-device loss, (CE(rows) + CE(columns)) / 2, in fp64."""
    logits = similarity_reference(image_features, text_features, logit_scale, logit_bias)
    labels = torch.arange(logits.shape[0], device=logits.device)
    ce = torch.nn.functional.cross_entropy
    return (ce(logits, labels) + ce(logits.T, labels)) / 2
