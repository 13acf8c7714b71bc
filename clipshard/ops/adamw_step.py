"""The fused AdamW step op (docs/optimizer.md): its fake kernel and a typed call. The optimizer
that uses it is clipshard.optim.AdamW."""
import torch

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)
from clipshard.ops import first_use


@torch.library.register_fake("clipshard::adamw_step_")
def _adamw_step_fake(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                     maximize, stochastic_rounding, seed, offset, tensor_numbers=None, index_bases=None):
    return None


def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, maximize,
                stochastic_rounding, seed, offset, tensor_numbers, index_bases):
    """One AdamW step over lists of tensors of one device, param dtype and state dtype, in place
    (the schema's comment in csrc/clipshard.cpp says what each argument is), by the compiled kernel
    (or its fallback if that failed its first-use check: clipshard/ops/first_use.py)."""
    step = first_use.kernel("adamw_step_", params[0].device, params[0].dtype, exp_avgs[0].dtype)
    step(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, maximize,
         stochastic_rounding, seed, offset, tensor_numbers, index_bases)
