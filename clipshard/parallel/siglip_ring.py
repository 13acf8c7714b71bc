"""Ring mode of the sharded SigLIP loss (docs/siglip.md, "Ring mode"): the text blocks travel around
the ring of ranks instead of being all-gathered, so a rank holds a few M x D blocks whatever the
world size.

SigLIP is a sum of independent per-logit terms, so rank r's loss sum splits over the text blocks:

    sum_{i in r, all j} softplus(-z_ij l_ij) = sum_q siglip_sum(I_r, T_q),

where only the own block (q = r, pos_offset 0) holds positives and every other block is all
negatives (pos_offset None). A pass: the blocks go around the ring (clipshard/parallel/_ring_pass.py, the
next one in flight during the current one's op call), each reduced by siglip_forward to its loss
sum, added in step order (fp64), and, when gradients are wanted, to the gradients of that sum for a
unit upstream gradient, weighted by w: d I_r and d scale / d bias accumulate here, d T_q in an fp32
(fp64 for fp64 features) buffer that travels one step behind T_q and brings every rank's part home
to q after N hops.

The text gradient mixes every rank's weight w_r = g_r / M_r (g_r: rank r's upstream gradient,
known only in the backward). The forward makes its pass with w_r = 1 / M_r, three GEMMs per chunk
as the gathered mode; the backward checks with one all-reduce of three numbers whether every rank's
g is the same (DDP's loss.backward(), one AMP or accumulation factor; a NaN on any rank counts as a
difference, so that it reaches every gradient it touches) and then only scales those gradients by
g. Otherwise it makes a second pass with w_r = g_r / M_r. Without gradients the forward is
loss-only (one GEMM per chunk). The result is the gathered implementation's
(clipshard/losses/siglip.py), which is open_clip's.
"""
import torch

from clipshard.ops.inputs import accumulate_dtype
from clipshard.parallel.collectives import same_on_every_rank
from clipshard.parallel._ring_pass import Ring, Travelling, blocks
from clipshard.ops.siglip_sum import siglip_block


def _pos_offset(step):
    """The own block (step 0) has the positives on its diagonal; the others have none."""
    return 0 if step == 0 else None


def _ring_pass(image, text, scale, bias, layout, algorithm, weight=None):
    """One pass of the text blocks around the ring: (this rank's loss sum in fp64, gradients). With
    a 0-dim `weight`, the gradients of weight * (loss sum): (d image, d text of this rank's own
    block, back after N hops, d scale, d bias), the features' in fp32 (fp64 for fp64), the scalars
    in fp64; without, the loss only (one GEMM per chunk) and None."""
    ring = Ring(layout)
    total = torch.zeros((), dtype=torch.float64, device=image.device)
    if weight is None:
        for step, block, _ in blocks(ring, text):
            total += siglip_block(image, block, scale, bias, _pos_offset(step), False, algorithm=algorithm)[0]
        return total, None
    acc = accumulate_dtype(image.dtype)  # fp32 accumulation for 16-bit features
    weight = weight.to(acc)
    d_image = torch.zeros(image.shape, dtype=acc, device=image.device)
    d_scale = torch.zeros((), dtype=torch.float64, device=image.device)
    d_bias = torch.zeros((), dtype=torch.float64, device=image.device)
    d_text = Travelling(ring, lambda total, part: part.to(acc).mul_(weight) if total is None
                        else total.addcmul_(part, weight))
    for step, block, _ in blocks(ring, text):
        loss, g_rows, g_cols, g_scale, g_bias = siglip_block(image, block, scale, bias, _pos_offset(step), True,
                                                             algorithm=algorithm)
        total += loss
        d_image.addcmul_(g_rows, weight)
        d_scale += g_scale.double()
        if bias is not None:
            d_bias += g_bias.double()
        d_text.fold(step, g_cols)
        del g_rows, g_cols  # not alive during the next block's work
    weight64 = weight.double()
    return total, (d_image, d_text.result(), d_scale * weight64, d_bias * weight64)


class _SigLipRingMean(torch.autograd.Function):
    """This rank's SigLIP loss (sum over its images against every rank's texts, divided by M_r)."""

    @staticmethod
    def forward(ctx, image, text, scale, bias, layout, algorithm, with_grad):
        image = image.contiguous()
        weight = torch.tensor(1.0 / layout.local_size, dtype=torch.float64, device=image.device)
        total, unit = _ring_pass(image, text, scale, bias, layout, algorithm, weight if with_grad else None)
        ctx.save_for_backward(image, text, scale, bias)
        ctx.layout, ctx.algorithm = layout, algorithm
        ctx.unit_grads = unit  # the gradients for a unit upstream gradient, if the forward made them
        return (total * weight).to(accumulate_dtype(image.dtype))

    @staticmethod
    def backward(ctx, grad):
        image, text, scale, bias = ctx.saved_tensors
        layout, unit = ctx.layout, ctx.unit_grads
        ctx.unit_grads = None
        if unit is not None and same_on_every_rank(grad, layout):
            # every rank weighs its loss alike: the forward's travelling text gradients are right
            factor, grads = grad, unit
        else:  # a second pass, with this rank's own weight on every block of its row
            weight = grad.double() / layout.local_size
            factor, grads = None, _ring_pass(image, text, scale, bias, layout, ctx.algorithm, weight)[1]
        dtypes = (image.dtype, text.dtype, scale.dtype, None if bias is None else bias.dtype)
        out = tuple(None if d is None or (k == 3 and bias is None) else
                    (d if factor is None else d * factor.to(d.dtype)).to(d_type)
                    for k, (d, d_type) in enumerate(zip(grads, dtypes)))
        return tuple(g if need else None for g, need in zip(out, ctx.needs_input_grad[:4])) + (None, None, None)


def siglip_ring_loss(image, text, scale, bias, layout, algorithm="auto"):
    """This rank's SigLIP loss sum_{i < M_r, all j} softplus(-z_ij l_ij) / M_r (scale and bias 0-dim
    tensors, bias may be None), with the gathered implementation's value and gradients; no
    all-gather."""
    inputs = (image, text, scale) + ((bias,) if bias is not None else ())
    with_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    return _SigLipRingMean.apply(image, text, scale, bias, layout, algorithm, with_grad)
