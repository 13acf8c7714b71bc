"""References of one clipshard.optim.AdamW step (torch.ops.clipshard.adamw_step_): the exact fp64
update, the kernels' fp32 update operation by operation, and the random words of its streams."""
import numpy as np

from tests.references.stochastic_round import MASK32, philox4x32_10


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


def adamw_step_fp32_reference(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                              maximize=False):
    """The kernels' fp32 AdamW update (clipshard/adamw.h) in numpy float32, one IEEE-rounded operation
    at a time in the kernels' order, so that it gives their exact bits before storage rounding. Takes
    and returns decoded fp32 values (the second moment as v) as numpy arrays."""
    f = np.float32
    p, g, m, v = (np.asarray(t, dtype=f) for t in (param, grad, exp_avg, exp_avg_sq))
    decay, one_minus_beta1 = f(1.0 - lr * weight_decay), f(1.0 - beta1)
    neg_step_size, bc2_sqrt = f(-(lr / (1.0 - beta1 ** step))), f((1.0 - beta2 ** step) ** 0.5)
    if maximize:
        g = -g
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        p = p * decay
        m = m + one_minus_beta1 * (g - m)
        v = v * f(beta2) + (f(1.0 - beta2) * g) * g
        p = p + (neg_step_size * m) / (np.sqrt(v) / bc2_sqrt + f(eps))
    return p, m, v


def philox_words_at(seed: int, offset: int, stream: int, indices) -> np.ndarray:
    """The random word of each element index of Philox stream `stream` (clipshard/adamw.h): word
    i % 4 of Philox(key=seed, counter=(stream * 2^40 + i // 4, offset))."""
    seed, offset = seed % (1 << 64), offset % (1 << 64)
    i = np.asarray(indices, dtype=np.uint64)
    blocks = (np.uint64(stream) << np.uint64(40)) + (i >> np.uint64(2))
    counter = np.stack([blocks & np.uint64(MASK32), blocks >> np.uint64(32),
                        np.full_like(blocks, offset & MASK32), np.full_like(blocks, offset >> 32)], axis=1)
    words = philox4x32_10(counter, (seed & MASK32, seed >> 32))
    return words[np.arange(len(i)), (i & np.uint64(3)).astype(np.int64)]
