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

Sample ids and hard negatives (docs/siglip.md): the ids of a text block travel with it as its
companion, and each block's op call labels its same-id pairs ("multi": +1; "mask": no term). Rank
q's hard negatives are appended to its text block, so that the travelling block holds K_q + H_q
rows (and the ids, padded with H_q unused entries, as many); each step makes one more op call on the
block's last H_q rows, without positives and without ids, and their gradient travels home with the
texts' in the same accumulator. Without ids and hard negatives every step is today's single call.
"""
from dataclasses import dataclass

import torch

from clipshard.ops.inputs import accumulate_dtype
from clipshard.parallel.collectives import same_on_every_rank
from clipshard.parallel.layout import ShardLayout
from clipshard.parallel._ring_pass import Ring, Travelling, blocks
from clipshard.ops.siglip_sum import siglip_block


def _pos_offset(step):
    """The own block (step 0) has the positives on its diagonal; the others have none."""
    return 0 if step == 0 else None


@dataclass(frozen=True)
class _Extras:
    """This rank's sample ids (or None) with "mask"'s flag, and its hard negatives (or None: no rank
    has any)."""

    ids: object = None
    mask_same_ids: bool = False
    negatives: object = None


def _travelling(text, layout, extras):
    """(ring, block, companion) of this rank: the text block with the hard negatives appended, on a
    ring whose block sizes are K_q + H_q, and the ids padded to that length."""
    if extras.negatives is None:
        return Ring(layout), text, extras.ids
    sizes = tuple(k + h for k, h in zip(layout.sizes, layout.negative_sizes))
    ring = Ring(ShardLayout(sizes=sizes, rank=layout.rank, group=layout.group))
    block = torch.cat([text, extras.negatives])
    ids = extras.ids
    if ids is not None:  # the hard negatives' entries are never read
        ids = torch.cat([ids, ids.new_zeros(extras.negatives.shape[0])])
    return ring, block, ids


def _block_calls(image, block, ids, k, scale, bias, step, with_grad, algorithm, extras):
    """siglip_block's outputs for the k texts of `block` (labelled by ids when given) and, after them,
    the block's hard negatives (every pair -1); one call without extras."""
    kwargs = {}
    if extras.ids is not None:
        kwargs = dict(row_ids=extras.ids, col_ids=ids[:k], mask_same_ids=extras.mask_same_ids)
    texts = block if block.shape[0] == k else block[:k]
    outputs = [siglip_block(image, texts, scale, bias, _pos_offset(step), with_grad, algorithm=algorithm, **kwargs)]
    if block.shape[0] > k:
        outputs.append(siglip_block(image, block[k:], scale, bias, None, with_grad, algorithm=algorithm))
    return outputs


def _ring_pass(image, text, scale, bias, layout, algorithm, weight=None, extras=_Extras()):
    """One pass of the text blocks around the ring: (this rank's loss sum in fp64, gradients). With
    a 0-dim `weight`, the gradients of weight * (loss sum): (d image, d text of this rank's own
    block, back after N hops, d scale, d bias), the features' in fp32 (fp64 for fp64), the scalars
    in fp64; without, the loss only (one GEMM per chunk) and None. With hard negatives the text
    gradient holds this rank's K_r text rows, then its H_r hard negatives' rows."""
    ring, own_block, own_ids = _travelling(text, layout, extras)
    sizes, n = layout.sizes, layout.world_size
    total = torch.zeros((), dtype=torch.float64, device=image.device)
    if weight is None:
        for step, block, ids in blocks(ring, own_block, own_ids):
            k = sizes[(layout.rank - step) % n]
            for out in _block_calls(image, block, ids, k, scale, bias, step, False, algorithm, extras):
                total += out[0]
        return total, None
    acc = accumulate_dtype(image.dtype)  # fp32 accumulation for 16-bit features
    weight = weight.to(acc)
    d_image = torch.zeros(image.shape, dtype=acc, device=image.device)
    d_scale = torch.zeros((), dtype=torch.float64, device=image.device)
    d_bias = torch.zeros((), dtype=torch.float64, device=image.device)
    d_text = Travelling(ring, lambda total, part: part.to(acc).mul_(weight) if total is None
                        else total.addcmul_(part, weight))
    for step, block, ids in blocks(ring, own_block, own_ids):
        k = sizes[(layout.rank - step) % n]
        d_text.arrive()  # the accumulator of this block is in; the one sent on is freed
        g_cols = []
        for loss, g_rows, g_part, g_scale, g_bias in _block_calls(image, block, ids, k, scale, bias, step, True,
                                                                  algorithm, extras):
            total += loss
            d_image.addcmul_(g_rows, weight)
            d_scale += g_scale.double()
            if bias is not None:
                d_bias += g_bias.double()
            g_cols.append(g_part)
            del g_rows, g_part
        d_text.fold(step, g_cols[0] if len(g_cols) == 1 else torch.cat(g_cols))
        del g_cols, block  # not alive during the next block's work (nor when its buffer is allocated)
    weight64 = weight.double()
    return total, (d_image, d_text.result(), d_scale * weight64, d_bias * weight64)


class _SigLipRingMean(torch.autograd.Function):
    """This rank's SigLIP loss (sum over its images against every rank's texts and hard negatives,
    divided by M_r)."""

    @staticmethod
    def forward(ctx, image, text, scale, bias, negatives, ids, layout, algorithm, mask_same_ids, with_grad):
        image = image.contiguous()
        extras = _Extras(ids, mask_same_ids, negatives)
        weight = torch.tensor(1.0 / layout.local_size, dtype=torch.float64, device=image.device)
        total, unit = _ring_pass(image, text, scale, bias, layout, algorithm, weight if with_grad else None, extras)
        ctx.save_for_backward(image, text, scale, bias, negatives, ids)
        ctx.layout, ctx.algorithm, ctx.mask_same_ids = layout, algorithm, mask_same_ids
        ctx.unit_grads = unit  # the gradients for a unit upstream gradient, if the forward made them
        return (total * weight).to(accumulate_dtype(image.dtype))

    @staticmethod
    def backward(ctx, grad):
        image, text, scale, bias, negatives, ids = ctx.saved_tensors
        layout, unit = ctx.layout, ctx.unit_grads
        ctx.unit_grads = None
        # (sync-free or under torch.compile the forward made no unit pass: the question would be a host read)
        if unit is not None and same_on_every_rank(grad, layout):
            # every rank weighs its loss alike: the forward's travelling text gradients are right
            factor, grads = grad, unit
        else:  # a second pass, with this rank's own weight on every block of its row
            weight = grad.double() / layout.local_size
            extras = _Extras(ids, ctx.mask_same_ids, negatives)
            factor, grads = None, _ring_pass(image, text, scale, bias, layout, ctx.algorithm, weight, extras)[1]
        d_negatives = None
        if negatives is not None:  # the travelling gradient: the K_r texts' rows, then the H_r negatives'
            d_travel = grads[1]
            grads = (grads[0], d_travel[: text.shape[0]]) + tuple(grads[2:])
            d_negatives = d_travel[text.shape[0]:]
        dtypes = (image.dtype, text.dtype, scale.dtype, None if bias is None else bias.dtype)
        scaled = lambda d: d if factor is None else d * factor.to(d.dtype)  # noqa: E731
        out = tuple(None if d is None or (k == 3 and bias is None) else scaled(d).to(d_type)
                    for k, (d, d_type) in enumerate(zip(grads, dtypes)))
        out += (None if d_negatives is None else scaled(d_negatives).to(negatives.dtype),)
        return tuple(g if need else None for g, need in zip(out, ctx.needs_input_grad[:5])) + (None,) * 5


def siglip_ring_loss(image, text, scale, bias, layout, algorithm="auto", *, sample_ids=None, targets=None,
                     hard_negatives=None, sync_free=False):
    """This rank's SigLIP loss sum_{i < M_r, all j} softplus(-z_ij l_ij) / M_r (scale and bias 0-dim
    tensors, bias may be None), with the gathered implementation's value and gradients; no
    all-gather. sample_ids (this rank's, with targets "multi" or "mask") label the same-id pairs;
    hard_negatives (this rank's H_r x D, layout.negative_sizes every rank's H_q; None when no rank has
    any) are -1 columns for every image. sync_free (validate="on_change"): no host read, the
    backward always makes its own pass (the forward is loss-only), as under torch.compile."""
    inputs = (image, text, scale) + tuple(t for t in (bias, hard_negatives) if t is not None)
    # sync-free and under torch.compile the backward makes its own pass (see _SigLipRingMean.backward): the
    # forward is loss-only
    with_grad = (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
                 and not sync_free and not torch.compiler.is_compiling())
    return _SigLipRingMean.apply(image, text, scale, bias, hard_negatives, sample_ids, layout, algorithm,
                                 targets == "mask", with_grad)
