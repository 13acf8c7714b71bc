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


# --- Half-precision AdamW (clipshard.optim.AdamW) -------------------------------------------------

def adamw_step_reference(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                         maximize=False):
    """One torch.optim.AdamW step in fp64 (decoupled weight decay, bias correction). Takes the
    decoded values (second moment as v, whatever its storage) and returns the exact fp64
    (param, exp_avg, exp_avg_sq) before any rounding to storage."""
    p, g, m, v = (t.double() for t in (param, grad, exp_avg, exp_avg_sq))
    if maximize:
        g = -g
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2 ** step) ** 0.5 + eps
    p = p - lr / (1 - beta1 ** step) * m / denom
    return p, m, v


def _next_16bit(y, up):
    """The fp16/bf16 value next to each finite y (same dtype), towards +inf when up, else -inf."""
    bits = y.view(torch.int16).to(torch.int32) & 0xFFFF
    sign, magnitude = bits >> 15, bits & 0x7FFF
    away_from_zero = (sign == 0) == up
    new_magnitude = torch.where(magnitude == 0, 1, torch.where(away_from_zero, magnitude + 1, magnitude - 1))
    new_sign = torch.where(magnitude == 0, 0 if up else 1, sign)
    return ((new_sign << 15) | new_magnitude).to(torch.int16).view(y.dtype)


def half_neighbours(x, dtype):
    """(lo, hi): the two values of `dtype` around each finite fp64 value x, lo <= x <= hi (equal
    when x is representable). Used to check stochastic rounding results."""
    x = x.double()
    y = x.to(dtype)
    yd = y.double()
    lo = torch.where(yd <= x, y, _next_16bit(y, up=False))
    hi = torch.where(yd >= x, y, _next_16bit(y, up=True))
    return lo, hi
