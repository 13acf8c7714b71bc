"""The full-batch distillation losses (DistillClipLoss with local_loss=False) without a host read,
for validate="on_change" and torch.compile (docs/distributed.md, "Compiling and host syncs").

The eager default (distill_exchange._GlobalLosses) differentiates the partials (P_r, D_r) once with
the upstream gradient g when every rank's g is the same, which it learns with a host read, and once
per loss otherwise. Here the answer is not asked: the forward computes the partials twice, from two
identity copies of the inputs, and the backward differentiates copy c with the unit weight of loss
c alone; the two passes are the eager per-loss passes, run by autograd (so dynamo traces them).
The price: the partials' forward work and collectives twice.

- _TwoCopies: the identity on the inputs, twice, plus a zero probe (two numbers) that the losses
  add (the value is unchanged), so that its backward receives g_r, this rank's upstream gradient.
  Its backward weighs copy c's unit gradients by G_c = sum_q g_q,c (gather_with_grad=True) or g_r,c
  for the features, and by g_r,c after a sum over ranks for the logit scales (open_clip's gradients,
  as distill_exchange._GlobalLosses).
- _PerLossUnits: L = sum_r P_r / (2NM) from copy 0 (one all-reduce); backward: the unit weight of
  loss c, e_c / (2NM), to copy c's partials.
"""
import torch

from clipshard.parallel import collectives as cdist


def global_losses_two_passes(partials_fn, layout, gather_with_grad, n_features, inputs):
    """open_clip's local_loss=False (contrastive, distill), the same values on every rank.
    partials_fn(*inputs) gives this rank's 2 partials; the first n_features inputs are features, the
    rest logit scales."""
    *copies, probe = _TwoCopies.apply(layout, gather_with_grad, n_features, *inputs)
    n = len(inputs)
    first, second = partials_fn(*copies[:n]), partials_fn(*copies[n:])
    losses = _PerLossUnits.apply(first, second, layout)
    return losses + probe.to(losses.dtype)


class _PerLossUnits(torch.autograd.Function):

    @staticmethod
    def forward(ctx, first, second, layout):
        ctx.divisor = 2 * layout.total
        ctx.save_for_backward(first)  # a second backward without retain_graph raises torch's own error here
        return cdist.all_reduce_sum(first, layout) / ctx.divisor

    @staticmethod
    def backward(ctx, grad):
        first, = ctx.saved_tensors
        units = torch.eye(2, dtype=first.dtype, device=first.device) / ctx.divisor
        return units[0], units[1], None


class _TwoCopies(torch.autograd.Function):

    @staticmethod
    def forward(ctx, layout, gather_with_grad, n_features, *inputs):
        ctx.layout, ctx.gather_with_grad, ctx.n_features = layout, gather_with_grad, n_features
        ctx.dtypes, ctx.shapes = [t.dtype for t in inputs], [t.shape for t in inputs]
        probe = inputs[0].new_zeros(2, dtype=torch.float64)
        return tuple(t.view_as(t) for t in inputs) + tuple(t.view_as(t) for t in inputs) + (probe,)

    @staticmethod
    def backward(ctx, *grads):
        n = len(ctx.dtypes)
        first, second, own = grads[:n], grads[n:2 * n], grads[2 * n].detach().double()
        wanted = [k for k in range(n) if ctx.needs_input_grad[3 + k]]
        passes = [{k: torch.zeros(ctx.shapes[k], dtype=ctx.dtypes[k], device=own.device) if g[k] is None else g[k]
                   for k in wanted} for g in (first, second)]
        out = {}
        feature_weight = cdist.all_reduce_sum(own, ctx.layout) if ctx.gather_with_grad else own
        for k in (k for k in wanted if k < ctx.n_features):
            acc = torch.promote_types(ctx.dtypes[k], torch.float32)
            out[k] = sum(p[k].to(acc) * feature_weight[c].to(acc) for c, p in enumerate(passes)).to(ctx.dtypes[k])
        # the logit scales' gradients are summed over ranks: one all-reduce for all of them
        scalars = [k for k in wanted if k >= ctx.n_features]
        if scalars:
            units = torch.stack([torch.cat([p[k].double().reshape(-1) for k in scalars]) for p in passes])
            total = (own.unsqueeze(1) * cdist.all_reduce_sum(units, ctx.layout)).sum(0)
            for k, part in zip(scalars, total.split([ctx.shapes[k].numel() for k in scalars])):
                out[k] = part.to(ctx.dtypes[k]).reshape(ctx.shapes[k])
        return (None, None, None) + tuple(out.get(k) for k in range(n))
