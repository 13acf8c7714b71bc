"""The fused AdamW step op (docs/optimizer.md): its fake kernel and a typed call. The optimizer
that uses it is clipshard.optim.AdamW."""
import torch

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)


@torch.library.register_fake("clipshard::adamw_step_")
def _adamw_step_fake(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                     maximize, stochastic_rounding, seed, offset, tensor_numbers=None, index_bases=None):
    return None


def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, maximize,
                stochastic_rounding, seed, offset, tensor_numbers, index_bases):
    """One AdamW step over lists of tensors of one device, param dtype and state dtype, in place
    (the schema's comment in csrc/clipshard.cpp says what each argument is)."""
    torch.ops.clipshard.adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps,
                                    weight_decay, maximize, stochastic_rounding, seed, offset, tensor_numbers,
                                    index_bases)
