"""Pure-PyTorch references, computed in fp64 and materialising everything. Used by the tests and
the benchmarks as the ground truth; never used in training."""
import numpy as np
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


def siglip_sum_reference(rows, cols, scale, bias=None, pos_offset=0):
    """The loss_sum of torch.ops.clipshard.siglip_forward: sum_ij softplus(-z_ij * l_ij) with
    z_ij = +1 iff j == pos_offset + i, else -1 (every z_ij = -1 for pos_offset None),
    differentiable through autograd, fp64."""
    logits = similarity_reference(rows, cols, scale, bias)
    index = torch.arange(rows.shape[0], device=rows.device)
    labels = -torch.ones_like(logits)
    if pos_offset is not None:
        labels[index, pos_offset + index] = 1.0
    return -torch.nn.functional.logsigmoid(labels * logits).sum()


def siglip_loss_reference(image_features, text_features, logit_scale, logit_bias=None):
    """open_clip's single-device SigLipLoss, sum_ij softplus(-z_ij * l_ij) / B, in fp64."""
    return siglip_sum_reference(image_features, text_features, logit_scale, logit_bias) / image_features.shape[0]


def siglip_loss_rank_reference(image_features, text_features, logit_scale, logit_bias, sizes, upstream, rank):
    """What open_clip's SigLipLoss returns on `rank`, and the gradients that rank's features,
    logit_scale and logit_bias receive, in fp64, in one process.

    image_features, text_features: the global batch (sum(sizes) x D), rank q's rows starting at
    sum(sizes[:q]); rank q's loss is backpropagated with upstream gradient upstream[q]. Rank q's loss
    is its own images against all texts, divided by sizes[q] (unequal sizes generalise open_clip,
    which needs equal ones). Feature gradients: of sum_q upstream[q] * L_q (the texts take part in
    every rank's loss); logit_scale / logit_bias gradients: of upstream[rank] * L_rank.
    Returns (loss, d image_r, d text_r, d scale, d bias or None).
    """
    leaf = lambda t: None if t is None else t.detach().double().requires_grad_()  # noqa: E731
    image, text, scale, bias = (leaf(t) for t in (image_features, text_features, logit_scale, logit_bias))
    offsets = [sum(sizes[:q]) for q in range(len(sizes))]
    losses = [siglip_sum_reference(image[offsets[q]: offsets[q] + sizes[q]], text, scale, bias, offsets[q]) / sizes[q]
              for q in range(len(sizes))]
    feature_objective = sum(g * loss for g, loss in zip(upstream, losses))
    d_image, d_text = torch.autograd.grad(feature_objective, [image, text], retain_graph=True)
    scalars = [scale] + ([bias] if bias is not None else [])
    d_scalars = torch.autograd.grad(upstream[rank] * losses[rank], scalars)
    local = slice(offsets[rank], offsets[rank] + sizes[rank])
    return (losses[rank].detach(), d_image[local], d_text[local], d_scalars[0],
            d_scalars[1] if bias is not None else None)



def distill_lse_reference(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset=0,
                          want_columns=True):
    """The seven outputs of clipshard.ops.distill_lse.distill_lse (row_lse, pos_logit,
    teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross), materialising every logit,
    differentiable through autograd, fp64."""
    s = similarity_reference(rows, cols, scale)
    t = torch.stack([similarity_reference(r, c, ts) for r, c, ts in zip(teacher_rows, teacher_cols, teacher_scale)])
    index = torch.arange(rows.shape[0], device=rows.device)
    row_lse, teacher_row_lse = torch.logsumexp(s, dim=1), torch.logsumexp(t, dim=2)
    row_cross = (t.softmax(dim=2) * s).sum(dim=2)
    if want_columns:
        columns = torch.logsumexp(s, dim=0), torch.logsumexp(t, dim=1), (t.softmax(dim=1) * s).sum(dim=1)
    else:
        columns = s.new_empty(0), t.new_empty(t.shape[0], 0), t.new_empty(t.shape[0], 0)
    return (row_lse, s[index, pos_offset + index], teacher_row_lse, row_cross) + columns


def _distill_target(teacher_logits, average_after_softmax):
    """The distillation target (row softmax) of a list of teachers' logits."""
    if average_after_softmax:
        return torch.stack([t.softmax(dim=1) for t in teacher_logits]).mean(dim=0)
    return torch.stack(teacher_logits).mean(dim=0).softmax(dim=1)


def _distill_sums(image, text, scale, teacher_images, teacher_texts, teacher_scales, pos_offset,
                  average_after_softmax):
    """(sum of the row cross-entropies of image against text, sum of the distillation
    cross-entropies of those rows), fp64."""
    s = similarity_reference(image, text, scale)
    teachers = [similarity_reference(i, t, ts) for i, t, ts in zip(teacher_images, teacher_texts, teacher_scales)]
    log_softmax = s.log_softmax(dim=1)
    labels = torch.arange(s.shape[0], device=s.device) + pos_offset
    contrastive = -log_softmax.gather(1, labels.unsqueeze(1)).sum()
    distill = -(_distill_target(teachers, average_after_softmax) * log_softmax).sum()
    return torch.stack([contrastive, distill])


def distill_clip_loss_reference(image_features, text_features, logit_scale, teacher_image_features,
                                teacher_text_features, teacher_logit_scales, average_after_softmax=True):
    """open_clip's single-device DistillClipLoss, (contrastive, distill) as one fp64 tensor of two,
    for a list of teachers: the distillation target of each row (and column) is the mean of the
    teachers' softmaxes (average_after_softmax) or the softmax of the mean of their logits."""
    rows = _distill_sums(image_features, text_features, logit_scale, teacher_image_features, teacher_text_features,
                         teacher_logit_scales, 0, average_after_softmax)
    cols = _distill_sums(text_features, image_features, logit_scale, teacher_text_features, teacher_image_features,
                         teacher_logit_scales, 0, average_after_softmax)
    return (rows + cols) / (2 * image_features.shape[0])


def distill_clip_loss_rank_reference(features, teachers, sizes, upstream, rank, local_loss, gather_with_grad,
                                     average_after_softmax=True):
    """What open_clip's DistillClipLoss returns on `rank` and the gradients that rank's inputs
    receive, in fp64, in one process (clip_loss_rank_reference's conventions, for two losses).

    features: (image, text, logit_scale) of the global batch; teachers: (images, texts, scales)
    lists; upstream[q]: rank q's two upstream gradients (contrastive, distill). Returns (losses [2],
    gradients of (image_r, text_r, scale, teacher images_r..., teacher texts_r..., teacher scales...)).
    """
    leaf = lambda t: t.detach().double().requires_grad_()  # noqa: E731
    image, text, scale = (leaf(t) for t in features)
    t_images, t_texts, t_scales = ([leaf(t) for t in group] for group in teachers)
    leaves = [image, text] + t_images + t_texts + [scale] + t_scales
    upstream = [torch.as_tensor(g, dtype=torch.float64) for g in upstream]
    if len(sizes) == 1:
        local_loss, gather_with_grad = True, True
    offsets = [sum(sizes[:q]) for q in range(len(sizes))]
    block = lambda t, q: t[offsets[q]: offsets[q] + sizes[q]]  # noqa: E731

    def rank_losses(q, detach):
        other = (lambda t: t.detach()) if detach else (lambda t: t)  # noqa: E731
        rows = _distill_sums(block(image, q), other(text), scale, [block(t, q) for t in t_images],
                             [other(t) for t in t_texts], t_scales, offsets[q], average_after_softmax)
        cols = _distill_sums(block(text, q), other(image), scale, [block(t, q) for t in t_texts],
                             [other(t) for t in t_images], t_scales, offsets[q], average_after_softmax)
        return (rows + cols) / (2 * sizes[q])

    if local_loss and gather_with_grad:
        losses = [rank_losses(q, False) for q in range(len(sizes))]
        feature_objective = sum((g * loss).sum() for g, loss in zip(upstream, losses))
        loss = losses[rank]
    elif local_loss:
        loss = rank_losses(rank, True)
        feature_objective = (upstream[rank] * loss).sum()
    else:
        loss = distill_clip_loss_reference(image, text, scale, t_images, t_texts, t_scales, average_after_softmax)
        feature_objective = ((sum(upstream) if gather_with_grad else upstream[rank]) * loss).sum()
    n_features = 2 + 2 * len(t_images)
    grads = torch.autograd.grad(feature_objective, leaves[:n_features], retain_graph=True)
    scalar_grads = torch.autograd.grad((upstream[rank] * loss).sum(), leaves[n_features:])
    return loss.detach(), [block(g, rank) for g in grads] + list(scalar_grads)

# ---------------------------------------------------------------------------------------------
# Stochastic rounding references (docs/stochastic_rounding.md). Independent of the C++ headers:
# Philox4x32-10 written from the Random123 description, and the rounding rule computed from the
# float values (neighbours and spacing in exact fp64 arithmetic) rather than from bit fields.
# ---------------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key schedule increments (golden ratio, sqrt(3) - 1)


def philox4x32_10(counter, key):
    """Philox4x32 with 10 rounds on an (N, 4) array of 32-bit counters and a 2-word key; (N, 4) uint32.

    One round maps (c0, c1, c2, c3) to (hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0));
    the key is incremented by (W0, W1) before every round but the first."""
    c = [np.asarray(counter, dtype=np.uint64).reshape(-1, 4)[:, j].copy() for j in range(4)]
    k0, k1 = int(key[0]) & _MASK32, int(key[1]) & _MASK32
    for round_index in range(10):
        if round_index:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        p0 = c[0] * np.uint64(_PHILOX_M[0])  # exact: both factors < 2**32
        p1 = c[2] * np.uint64(_PHILOX_M[1])
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & np.uint64(_MASK32),
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & np.uint64(_MASK32)]
    return np.stack(c, axis=1).astype(np.uint32)


def philox_stream_reference(seed: int, offset: int, n: int) -> np.ndarray:
    """The random words of elements 0..n-1: word i % 4 of Philox(key=seed, counter=(i // 4, offset)),
    the counter's low 64 bits being i // 4 and its high 64 bits offset. seed, offset: uint64 values."""
    seed, offset = seed % (1 << 64), offset % (1 << 64)
    blocks = np.arange((n + 3) // 4, dtype=np.uint64)
    counter = np.stack([blocks & np.uint64(_MASK32), blocks >> np.uint64(32),
                        np.full_like(blocks, offset & _MASK32), np.full_like(blocks, offset >> 32)], axis=1)
    return philox4x32_10(counter, (seed & _MASK32, seed >> 32)).reshape(-1)[:n]


# Target format: (smallest normal, spacing exponent of the subnormals, mantissa bits, largest finite)
_SR_FORMATS = {
    torch.float16: (2.0 ** -14, -24, 10, 65504.0),
    torch.bfloat16: (2.0 ** -126, -133, 7, float.fromhex("0x1.fep127")),
}


def stochastic_round_reference(x: torch.Tensor, words, dtype, saturate: bool = False) -> torch.Tensor:
    """The stochastic-rounding rule from float values, given each element's random word (uint32).

    |x| lies in [lo, lo + ulp) on the target grid; x's own format (fp32) resolves it in steps of
    ulp32, so the target drops k = log2(ulp / ulp32) bits worth d = (|x| - lo) / ulp32. Round up iff
    (r mod 2^k) < d, or, when k > 32, iff r < floor(d / 2^(k - 32)). Past the largest finite value
    the next grid point is Inf (or the largest finite value when saturating)."""
    smallest_normal, sub_exp, mant_bits, largest = _SR_FORMATS[dtype]
    v = x.detach().cpu().contiguous().reshape(-1).double().numpy()
    r = np.asarray(words, dtype=np.uint64).reshape(-1)
    a = np.abs(v)
    finite = np.isfinite(a)
    safe = np.where(finite & (a > 0), a, 1.0)
    _, e = np.frexp(safe)  # safe = m * 2^e, m in [0.5, 1): floor(log2(safe)) = e - 1
    ulp = np.ldexp(1.0, np.maximum(e - 1 - mant_bits, sub_exp))
    ulp32 = np.ldexp(1.0, np.maximum(e - 1 - 23, -149))
    ulp = np.where(safe < smallest_normal, 2.0 ** sub_exp, ulp)
    lo = np.floor(safe / ulp) * ulp  # exact: power-of-two scaling
    k = np.round(np.log2(ulp / ulp32)).astype(np.int64)
    d = (safe - lo) / ulp32  # an integer, exact
    small_k = k <= 32
    mod = np.where(small_k, r % np.ldexp(1.0, np.minimum(k, 32)).astype(np.uint64), 0)
    up_small = mod.astype(np.float64) < d
    up_large = r.astype(np.float64) < np.floor(d / np.ldexp(1.0, np.maximum(k - 32, 0)))
    up = np.where(small_k, up_small, up_large)
    mag = np.where(up, lo + ulp, lo)
    mag = np.where(a == 0, 0.0, mag)
    mag = np.where(np.isinf(a) | (a >= largest + ulp), np.inf, mag)  # overflow, Inf stays Inf
    mag = np.where(mag > largest, largest if saturate else np.inf, mag)
    out = np.copysign(mag, v)
    out = np.where(np.isnan(v), np.nan, out)
    return torch.from_numpy(out).to(dtype).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# Distributed: open_clip's per-rank semantics (used by tests/test_distributed.py)
# ---------------------------------------------------------------------------------------------


def _cross_entropy_sum(logits, targets):
    return (torch.logsumexp(logits, dim=1) - logits.gather(1, targets[:, None])[:, 0]).sum()


def clip_loss_rank_reference(image_features, text_features, logit_scale, logit_bias, sizes, upstream,
                             rank, local_loss, gather_with_grad):
    """What open_clip's ClipLoss returns on `rank`, and the gradients that rank's features,
    logit_scale and logit_bias receive, in fp64, in one process.

    image_features, text_features: the global batch (sum(sizes) x D), rank q's rows starting at
    sum(sizes[:q]); rank q's loss is backpropagated with upstream gradient upstream[q].
    Unequal sizes generalise open_clip (which needs equal ones): labels are offset_q + i and a
    rank's mean runs over its own rows. Returns (loss, d image_r, d text_r, d scale, d bias or None).
    """
    leaf = lambda t: None if t is None else t.detach().double().requires_grad_()  # noqa: E731
    image, text, scale, bias = (leaf(t) for t in (image_features, text_features, logit_scale, logit_bias))
    if len(sizes) == 1:
        local_loss, gather_with_grad = True, True  # open_clip gathers nothing on one rank
    offsets = [sum(sizes[:q]) for q in range(len(sizes))]
    block = lambda t, q: t[offsets[q]: offsets[q] + sizes[q]]  # noqa: E731

    def rank_loss(q, other_text, other_image):
        labels = torch.arange(sizes[q]) + offsets[q]
        rows = similarity_reference(block(image, q), other_text, scale, bias)
        cols = similarity_reference(block(text, q), other_image, scale, bias)
        return (_cross_entropy_sum(rows, labels) + _cross_entropy_sum(cols, labels)) / (2 * sizes[q])

    def full_loss():
        logits = similarity_reference(image, text, scale, bias)
        labels = torch.arange(logits.shape[0])
        return (_cross_entropy_sum(logits, labels) + _cross_entropy_sum(logits.T, labels)) / (2 * logits.shape[0])

    if local_loss and gather_with_grad:
        losses = [rank_loss(q, text, image) for q in range(len(sizes))]
        feature_objective = sum(g * loss for g, loss in zip(upstream, losses))
        loss = losses[rank]
    elif local_loss:
        loss = rank_loss(rank, text.detach(), image.detach())
        feature_objective = upstream[rank] * loss
    else:
        loss = full_loss()
        feature_objective = (sum(upstream) if gather_with_grad else upstream[rank]) * loss
    d_image, d_text = torch.autograd.grad(feature_objective, [image, text], retain_graph=True)
    scalars = [scale] + ([bias] if bias is not None else [])
    d_scalars = torch.autograd.grad(upstream[rank] * loss, scalars)
    d_bias = d_scalars[1] if bias is not None else None
    return loss.detach(), block(d_image, rank), block(d_text, rank), d_scalars[0], d_bias


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


def round_to_nearest_reference(x, dtype):
    """Each finite fp64 value x (within dtype's range) rounded to the nearest `dtype` value, ties to
    even, decided from the distances to the two neighbours in fp64 (exact for values of fp32
    precision) rather than taken on trust from a cast."""
    x = x.double()
    lo, hi = half_neighbours(x, dtype)
    below, above = x - lo.double(), hi.double() - x
    lo_is_even = (lo.view(torch.int16) & 1) == 0
    return torch.where((below < above) | ((below == above) & lo_is_even), lo, hi)


# --- A training problem for clipshard.optim.AdamW: the stall that stochastic rounding prevents ----


def stall_regression(param_dtype, stochastic_rounding, steps=400, lr=1e-3, device="cpu"):
    """Least-squares regression (256 samples, 64 weights initialised at 1.0, targets from weights
    1 + 0.1 * N(0, 1)) trained with clipshard.optim.AdamW (no weight decay; rounding bits from a
    generator seeded with 4). Adam moves each weight by about lr per step: with lr 1e-3 that is below
    half an ulp of bf16 at 1.0 (2^-8), so round to nearest never moves a bf16 weight while
    stochastic rounding follows fp32 training. Returns (the loss before each step, final weights)."""
    from clipshard.optim import AdamW  # here, not at the top: clipshard.optim may import this module


    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 64, generator=gen).to(device)
    y = x @ (1.0 + 0.1 * torch.randn(64, generator=gen)).to(device)
    w = torch.ones(64, dtype=param_dtype, device=device, requires_grad=True)
    opt = AdamW([w], lr=lr, weight_decay=0.0, stochastic_rounding=stochastic_rounding,
                generator=torch.Generator(device=device).manual_seed(4))
    losses = []
    for _ in range(steps):
        loss = ((x @ w.float() - y) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, w.detach()


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
    counter = np.stack([blocks & np.uint64(_MASK32), blocks >> np.uint64(32),
                        np.full_like(blocks, offset & _MASK32), np.full_like(blocks, offset >> 32)], axis=1)
    words = philox4x32_10(counter, (seed & _MASK32, seed >> 32))
    return words[np.arange(len(i)), (i & np.uint64(3)).astype(np.int64)]
