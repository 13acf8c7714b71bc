"""siglip_sum with algorithm="torch": the chunked sigmoid loss in PyTorch operations only
(docs/portable.md).

Per chunk of Kc columns one GEMM gives the raw similarities, l = s * dots + b the logits, and with
t = -z * l (the chunk's positives negated in place on its diagonal)

    loss += sum softplus(t),    dl = d loss / d l = -z * sigmoid(t)  (sigmoid in place, diagonal negated back),

then, when a gradient will be needed, d scale += sum(dl * dots), d bias += sum(dl), and the two
gradient GEMMs of dl (times s, applied to their M x D and Kc x D results). Like the compiled op (clipshard/ops/siglip_sum.py), the gradients of the sum
are computed in the forward pass and only scaled by the upstream gradient in the backward: three
GEMMs per chunk instead of the four a recomputing backward needs. What it costs is memory held from
the forward to the backward: the gradients (M + K) x D, the size of the features themselves, which a
backward would allocate anyway; the loss is the last step before backward in a training step, so
the time they are held is short. Per-chunk temporaries, counted against workspace_bytes: the dots,
the logits and softplus's output (or the dl * dots product), plus dl rounded to 16 bits where the
GEMMs take 16-bit factors; without a gradient the logits overwrite the dots (two buffers).

Sample ids (row_ids, col_ids; docs/targets.md): per chunk an M x Kc boolean marks the same-id pairs
other than the own pair. mask_same_ids: they have no term (their softplus, dl and dl * dot set to 0,
so that an Inf or NaN similarity there leaves no trace, as in the kernels); else
they are positives (z = +1: t and dl multiplied by a -1/+1 sign buffer, one more M x Kc buffer).
Both counted in the budget. Without ids the code path, and so every bit, is the one without them.
"""
import torch

from clipshard.ops._portable_chunks import Chunks, GradientGemms, fp16_prescale, rows_per_block


def _forward(rows, cols, scale, bias, pos_offset, with_grad, budget, saved_dtype, row_ids=None, col_ids=None,
             mask_same_ids=False):
    with_ids = row_ids is not None
    sign_buffers = 1 if with_ids and not mask_same_ids else 0
    chunks = Chunks(rows, cols, budget, acc_buffers=(3 if with_grad else 2) + sign_buffers,
                    with_grad_gemms=with_grad, extra_bytes=1 if with_ids else 0)
    acc = chunks.acc
    s = scale.to(acc)
    b = None if bias is None else bias.to(acc)
    loss = torch.zeros((), dtype=acc, device=rows.device)
    grad_scale = torch.zeros((), dtype=acc, device=rows.device)
    grad_bias = torch.zeros((), dtype=acc, device=rows.device)
    gemms = None
    if with_grad:
        one = torch.ones((), dtype=acc, device=rows.device)
        prescale = fp16_prescale(one) if chunks.grad_dtype == torch.float16 else None  # |dl| <= 1
        gemms = GradientGemms(chunks, s, saved_dtype, prescale)
    for begin, width in chunks:
        dots = chunks.dots(begin, width)
        if with_grad:  # the dots are needed for d scale: the logits go to a new buffer, in one pass
            t = torch.addcmul(b, dots, s) if b is not None else dots * s
        else:
            t = dots.mul_(s) if b is None else dots.mul_(s).add_(b)
        # pos_offset None: no positives, t = l everywhere (an empty diagonal view does nothing)
        diagonal = t.new_empty(0) if pos_offset is None else chunks.positives(t, begin, pos_offset)[2]
        diagonal.neg_()  # t = -z * l
        same = sign = None
        if with_ids:
            same = chunks.other_same_ids(row_ids, col_ids, begin, width, pos_offset)
            if not mask_same_ids:  # z = +1 on the other same-id pairs too
                sign = same.to(acc).mul_(-2.0).add_(1.0)
                t.mul_(sign)
        # softplus(t) returns t itself above `threshold`, dropping log1p(exp(-t)): at 40 that is below
        # half an fp64 ulp of t (the default 20 would cost fp64 sums up to 2e-9 per logit)
        if mask_same_ids and with_ids:  # those pairs have no term
            loss += torch.nn.functional.softplus(t, threshold=40.0).masked_fill_(same, 0.0).sum()
        else:
            loss += torch.nn.functional.softplus(t, threshold=40.0).sum()
        if with_grad:
            dl = torch.sigmoid_(t)
            diagonal.neg_()  # dl = -z * sigmoid(t)
            if sign is not None:
                dl.mul_(sign)
            elif same is not None:
                dl.masked_fill_(same, 0.0)
            # a dropped pair adds nothing to d scale either, whatever its dot: 0 * Inf or NaN would
            # be NaN (the rule of every path: a dropped pair is skipped, as if it were not there)
            grad_scale += ((dl * dots).masked_fill_(same, 0.0) if mask_same_ids and with_ids else dl * dots).sum()
            grad_bias += dl.sum()
            gemms.add(dl, begin, width)
            del dl
        del dots, t, diagonal, same, sign  # before the next chunk's GEMM allocates its result
    if not with_grad:
        return loss, None
    grad_rows, grad_cols = gemms.results()
    return loss, (grad_rows, grad_cols, grad_scale.to(scale.dtype), None if bias is None else grad_bias.to(bias.dtype))


class _SiglipSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, cols, scale, bias, pos_offset, with_grad, budget, saved_dtype, row_ids, col_ids,
                mask_same_ids):
        loss, grads = _forward(rows, cols, scale, bias, pos_offset, with_grad, budget, saved_dtype, row_ids, col_ids,
                               mask_same_ids)
        ctx.with_grad = with_grad
        ctx.feature_dtype = rows.dtype
        ctx.rows_per_step = rows_per_block(rows.shape[1], budget)
        ctx.save_for_backward(*(grads or ()))  # freed after the backward, unless retain_graph
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if not ctx.with_grad:
            raise RuntimeError("siglip_sum: the forward ran without gradients (no input required one under grad "
                               "mode), so it kept none")
        grad_rows, grad_cols, grad_scale, grad_bias = ctx.saved_tensors
        scaled = [_scaled(g, grad_loss, ctx.feature_dtype, ctx.rows_per_step) for g in (grad_rows, grad_cols)]
        scaled += [None if g is None else (g * grad_loss).to(g.dtype) for g in (grad_scale, grad_bias)]
        return (*scaled, None, None, None, None, None, None, None)


def _scaled(grad, grad_loss, dtype, rows_per_step):
    """grad * grad_loss in `dtype`, computed in grad_loss's dtype (fp32 or fp64) and rounded once,
    a block of rows at a time, so that no full-size fp32 temporary is made."""
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    for begin in range(0, grad.shape[0], rows_per_step):
        rows = min(rows_per_step, grad.shape[0] - begin)
        out.narrow(0, begin, rows).copy_(grad.narrow(0, begin, rows).to(grad_loss.dtype) * grad_loss)
    return out


def siglip_block_torch(rows, cols, scale, bias, pos_offset, with_grad, budget, saved_dtype, row_ids=None,
                       col_ids=None, mask_same_ids=False):
    """The torch path of siglip_forward without autograd: (loss_sum, grad_rows, grad_cols, grad_scale,
    grad_bias), the gradients of the sum for a unit upstream gradient (None without with_grad)."""
    loss, grads = _forward(rows, cols, scale, bias, pos_offset, with_grad, budget, saved_dtype, row_ids, col_ids,
                           mask_same_ids)
    return (loss,) + (grads or (None,) * 4)


def siglip_sum_torch(rows, cols, scale, bias, pos_offset, with_grad, budget, saved_dtype, row_ids=None,
                     col_ids=None, mask_same_ids=False):
    """siglip_sum's value by the torch path; the arguments were checked by the caller. saved_dtype:
    the dtype the feature gradients of the sum are kept in until the backward (siglip_sum's rule);
    row_ids / col_ids: the sample ids, their same-id pairs dropped (mask_same_ids) or positives."""
    return _SiglipSum.apply(rows, cols, scale, bias, pos_offset, with_grad, budget, saved_dtype, row_ids, col_ids,
                            mask_same_ids)
