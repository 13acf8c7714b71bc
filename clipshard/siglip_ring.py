"""Ring mode of the sharded SigLIP loss (docs/siglip.md, "Ring mode"): the text blocks travel around
the ring of ranks instead of being all-gathered, so a rank holds a few M x D blocks whatever the
world size.

SigLIP is a sum of independent per-logit terms, so rank r's loss sum splits over the text blocks:

    sum_{i in r, all j} softplus(-z_ij l_ij) = sum_q siglip_sum(I_r, T_q),

where only the own block (q = r, pos_offset 0) holds positives and every other block is all
negatives (pos_offset None). Forward: the blocks pass around the ring (clipshard/_ring_pass.py, the
next one in flight during the current one's op call) and each is reduced to its loss sum with
siglip_forward's loss-only pass (one GEMM per chunk); the block sums are added in step order (fp64).
Backward: with this rank's upstream gradient g (of its loss sum) known, the blocks go around again
and each is recomputed with with_grad (three GEMMs per chunk), the op's unit-upstream gradients
weighted by g: d I_r and d scale / d bias accumulate here, d T_q in an fp32 (fp64 for fp64
features) buffer that travels one step behind T_q and brings every rank's part home to q after N
hops. The result is the gathered implementation's (clipshard/siglip.py), which is open_clip's.
"""
import torch

from clipshard._block_checks import accumulate_dtype
from clipshard._ring_pass import Ring, Travelling, blocks
from clipshard.siglip_op import siglip_block


def _pos_offset(step):
    """The own block (step 0) has the positives on its diagonal; the others have none."""
    return 0 if step == 0 else None


class _SigLipRingSum(torch.autograd.Function):
    """This rank's SigLIP loss sum over its images against every rank's texts, by ring."""

    @staticmethod
    def forward(ctx, image, text, scale, bias, layout, algorithm):
        ring = Ring(layout)
        image = image.contiguous()
        total = torch.zeros((), dtype=torch.float64, device=image.device)
        for step, block, _ in blocks(ring, text):
            total += siglip_block(image, block, scale, bias, _pos_offset(step), False, algorithm=algorithm)[0]
        ctx.save_for_backward(image, text, scale, bias)
        ctx.layout, ctx.algorithm = layout, algorithm
        return total.to(accumulate_dtype(image.dtype))

    @staticmethod
    def backward(ctx, grad):
        image, text, scale, bias = ctx.saved_tensors
        ring = Ring(ctx.layout)
        acc = accumulate_dtype(image.dtype)  # fp32 accumulation for 16-bit features
        grad = grad.to(acc)
        d_image = torch.zeros(image.shape, dtype=acc, device=image.device)
        d_scale = torch.zeros((), dtype=torch.float64, device=image.device)
        d_bias = torch.zeros((), dtype=torch.float64, device=image.device)
        d_text = Travelling(ring, lambda total, part: part.to(acc).mul_(grad) if total is None
                            else total.addcmul_(part, grad))
        for step, block, _ in blocks(ring, text):
            _, g_rows, g_cols, g_scale, g_bias = siglip_block(image, block, scale, bias, _pos_offset(step), True,
                                                              algorithm=ctx.algorithm)
            d_image.addcmul_(g_rows, grad)
            d_scale += g_scale.double()
            if bias is not None:
                d_bias += g_bias.double()
            d_text.fold(step, g_cols)
            del g_rows, g_cols  # not alive during the next block's work
        grad64 = grad.double()
        grads = (d_image.to(image.dtype), d_text.result().to(text.dtype),
                 (d_scale * grad64).to(scale.dtype), None if bias is None else (d_bias * grad64).to(bias.dtype))
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:4])) + (None, None)


def siglip_ring_sum(image, text, scale, bias, layout, algorithm="auto"):
    """sum_{i < M_r, all j} softplus(-z_ij l_ij) of this rank (scale and bias 0-dim tensors, bias
    may be None), with the gathered implementation's value and gradients; no all-gather."""
    return _SigLipRingSum.apply(image, text, scale, bias, layout, algorithm)
