"""clipshard.GradCache with sample ids and hard negative texts: sample_ids reach loss_fn
whole; the hard negatives run through encode_text in micro-batches in both passes; loss and every
parameter gradient equal the plain step's (fp64 within 1e-10, dropout on, odd sizes, upstream
0.5 / M), for "mask" and "multi" targets, dict and tuple outputs, nested backward and `parameters`
mode. The loss here is a materialised fp64 reference of the objective (docs/targets.md), so the test
checks GradCache alone, whatever the fused losses do. Bad ids / negatives are refused by name."""
import functools

import pytest
import torch

import clipshard
from tests.integrations.ids_references import materialised_clip_loss
from tests.integrations.grad_cache.grad_cache_models import TOKENS, VOCAB, TinyClip, batch, grads, max_relative_difference

M, H, MICRO = 23, 11, 5  # odd: the last micro-batch of each is shorter


def _ids(seed):
    """M ids with duplicates (7 distinct values)."""
    return torch.randint(0, 7, (M,), generator=torch.Generator().manual_seed(seed))


def _negatives(count, seed):
    return torch.randint(0, VOCAB, (count, TOKENS), generator=torch.Generator().manual_seed(seed))


def _plain_step(model, loss_fn, images, tokens, ids, negative_tokens, upstream, encode_text=None):
    """The step without the cache, drawing dropout in GradCache's order (the model's micro-batches,
    then the negatives'): every graph kept, one backward."""
    outputs = [model(i, t) for i, t in zip(images.split(MICRO), tokens.split(MICRO))]
    first = outputs[0]
    if isinstance(first, dict):
        values = {k: torch.cat([o[k] for o in outputs]) if k.endswith("features") else v for k, v in first.items()}
    else:
        values = (torch.cat([o[0] for o in outputs]), torch.cat([o[1] for o in outputs]), *first[2:])
    keywords = {"sample_ids": ids}
    if negative_tokens is not None:
        encode_text = encode_text or model.encode_text
        keywords["hard_negatives"] = torch.cat([encode_text(t) for t in negative_tokens.split(MICRO)])
    loss = loss_fn(**values, **keywords) if isinstance(values, dict) else loss_fn(*values, **keywords)
    (loss * upstream).backward()
    return loss.detach()


def _both_steps(loss_fn, *, as_tuple=False, parameters_mode=False, negatives=H, seed=1, with_bias=False):
    images, tokens = batch(M, seed)
    ids = _ids(seed)
    negative_tokens = None if negatives is None else _negatives(negatives, seed + 100)
    upstream = 0.5 / M
    results = []
    for cached in (True, False):
        torch.manual_seed(7)
        model = TinyClip(dropout=0.2, as_tuple=as_tuple, with_bias=with_bias)
        if cached:
            cache = clipshard.GradCache(model, loss_fn, MICRO, encode_text=model.encode_text,
                                        parameters=model.parameters() if parameters_mode else None)
            loss = cache(images, tokens, sample_ids=ids, hard_negative_texts=negative_tokens)
            (loss * upstream).backward()
            loss = loss.detach()
        else:
            loss = _plain_step(model, loss_fn, images, tokens, ids, negative_tokens, upstream)
        results.append((grads(model), loss))
    return results


@pytest.mark.parametrize("targets", ["mask", "multi"])
@pytest.mark.parametrize("as_tuple,parameters_mode", [(False, False), (True, False), (False, True)],
                         ids=["dict", "tuple", "parameters-mode"])
def test_ids_and_hard_negatives_give_the_plain_steps_loss_and_gradients(targets, as_tuple, parameters_mode):
    loss_fn = lambda *a, **k: materialised_clip_loss(*a, **k, targets=targets)  # noqa: E731
    (ours, our_loss), (reference, reference_loss) = _both_steps(loss_fn, as_tuple=as_tuple,
                                                               parameters_mode=parameters_mode)
    assert set(ours) == {n for n, _ in TinyClip(with_bias=False).named_parameters()}
    difference = max_relative_difference(ours, reference)
    print(f"  {targets}, tuple {as_tuple}, parameters mode {parameters_mode}: gradients {difference:.3g}, "
          f"loss {abs(our_loss - reference_loss) / abs(reference_loss):.3g}")
    assert difference <= 1e-10
    assert abs(our_loss - reference_loss) <= 1e-10 * abs(reference_loss)
    # the negatives matter: without them the text tower's gradient is clearly another one
    (without, _), _ = _both_steps(loss_fn, as_tuple=as_tuple, parameters_mode=parameters_mode, negatives=None)
    assert max_relative_difference({k: without[k] for k in ("text.2.weight",)},
                                   {k: reference[k] for k in ("text.2.weight",)}) > 1e-3


@pytest.mark.parametrize("loss", ["ClipLoss", "SigLipLoss"])
@pytest.mark.parametrize("targets", ["mask", "multi"])
def test_clipshards_losses_with_ids_and_hard_negatives_give_the_plain_steps_gradients(loss, targets):
    loss_fn = functools.partial(getattr(clipshard, loss)(), targets=targets)
    (ours, our_loss), (reference, reference_loss) = _both_steps(loss_fn, with_bias=loss == "SigLipLoss", seed=9)
    difference = max_relative_difference(ours, reference)
    print(f"  {loss} {targets}: gradients {difference:.3g}")
    assert difference <= 1e-10
    assert abs(our_loss - reference_loss) <= 1e-10 * abs(reference_loss)


def test_ids_alone_and_zero_hard_negatives():
    """sample_ids without negatives (no encode_text needed), and H = 0 negatives (a rank may have
    none): the plain step's gradients."""
    loss_fn = lambda *a, **k: materialised_clip_loss(*a, **k, targets="mask")  # noqa: E731
    for negatives in (None, 0):
        (ours, our_loss), (reference, reference_loss) = _both_steps(loss_fn, negatives=negatives, seed=3)
        assert max_relative_difference(ours, reference) <= 1e-10
        assert abs(our_loss - reference_loss) <= 1e-10 * abs(reference_loss)


def test_sample_ids_reach_the_loss_whole_and_evaluation_is_the_loss():
    seen = []

    def recording_loss(sample_ids=None, hard_negatives=None, **outputs):
        seen.append((sample_ids, hard_negatives))
        return materialised_clip_loss(**outputs, sample_ids=sample_ids, hard_negatives=hard_negatives, targets="multi")

    model = TinyClip(with_bias=False)
    images, tokens = batch(M, 4)
    ids, negative_tokens = _ids(4), _negatives(H, 5)
    cache = clipshard.GradCache(model, recording_loss, MICRO, encode_text=model.encode_text)
    cache(images, tokens, sample_ids=ids).backward()
    assert seen[0][0] is ids and seen[0][1] is None
    with torch.no_grad():
        loss = cache(images, tokens, sample_ids=ids, hard_negative_texts=negative_tokens)
        output = model(images, tokens)
        reference = materialised_clip_loss(**output, sample_ids=ids, hard_negatives=model.encode_text(negative_tokens),
                                           targets="multi")
    assert seen[1][1].shape == (H, 8)
    assert abs(loss - reference) <= 1e-12 * abs(reference)


@pytest.mark.parametrize("call,error,match", [
    (lambda c, i, t: c(i, t, sample_ids=torch.arange(M - 1)), ValueError,
     r"sample_ids must be a 1-D int64 tensor with one id per pair \(23\), got torch.int64 of shape \(22,\)"),
    (lambda c, i, t: c(i, t, sample_ids=torch.arange(M).int()), ValueError, "sample_ids must be a 1-D int64 tensor"),
    (lambda c, i, t: c(i, t, sample_ids=list(range(M))), ValueError, "sample_ids must be .* got list"),
    (lambda c, i, t: c(i, t, hard_negative_texts={"a": _negatives(3, 0), "b": _negatives(4, 0)}), ValueError,
     r"the tensors of hard_negative_texts must have the same batch size"),
    (lambda c, i, t: c(i, t, hard_negative_texts=5), TypeError, "hard_negative_texts must be a tensor"),
], ids=["ids-length", "ids-dtype", "ids-list", "negatives-rows", "negatives-int"])
def test_bad_ids_and_negatives_are_refused_naming_the_argument(call, error, match):
    model = TinyClip(with_bias=False)
    cache = clipshard.GradCache(model, materialised_clip_loss, MICRO, encode_text=model.encode_text)
    with pytest.raises(error, match=match):
        call(cache, *batch(M, 6))
    assert all(p.grad is None for p in model.parameters())


def test_hard_negatives_need_a_text_tower_that_runs_alone():
    model = TinyClip(with_bias=False)
    with pytest.raises(ValueError, match=r"hard_negative_texts needs GradCache\(\.\.\., encode_text=\.\.\.\)"):
        clipshard.GradCache(model, materialised_clip_loss, MICRO)(*batch(M, 6), hard_negative_texts=_negatives(H, 0))
    with pytest.raises(TypeError, match="encode_text must be callable or None, got int"):
        clipshard.GradCache(model, materialised_clip_loss, MICRO, encode_text=3)
    cache = clipshard.GradCache(model, materialised_clip_loss, MICRO, encode_text=lambda t: model.encode_text(t)[:-1])
    with pytest.raises(ValueError, match=r"encode_text must return the features of its texts, a tensor of shape "
                                         r"\(5, D\) for this micro-batch of hard_negative_texts, got \(4, 8\)"):
        cache(*batch(M, 6), hard_negative_texts=_negatives(H, 0))


def _ddp_on_ranks(rank, world_size):
    """(gradients, DDP reductions, loss) of GradCache and of the plain DDP step, on this rank: a DDP
    model, the rank's own materialised loss with ids and its hard negatives (11 on rank 0, none on
    rank 1), the negatives through ddp.module.encode_text."""
    import io

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    images, tokens = batch(M, 20 + rank)
    ids, negative_tokens = _ids(20 + rank), _negatives(H if rank == 0 else 0, 30 + rank)
    loss_fn = lambda *a, **k: materialised_clip_loss(*a, **k, targets="multi")  # noqa: E731
    results = []
    for cached in (True, False):
        torch.manual_seed(7 + rank)
        ddp = torch.nn.parallel.DistributedDataParallel(TinyClip(dropout=0.2, with_bias=False))
        reductions = []
        ddp.register_comm_hook(None, lambda state, bucket: reductions.append(1) or allreduce_hook(state, bucket))
        if cached:
            cache = clipshard.GradCache(ddp, loss_fn, MICRO, encode_text=ddp.module.encode_text)
            loss = cache(images, tokens, sample_ids=ids, hard_negative_texts=negative_tokens)
            (loss * 0.5 / M).backward()
        else:
            loss = _plain_step(ddp, loss_fn, images, tokens, ids, negative_tokens, 0.5 / M, ddp.module.encode_text)
        results.append((grads(ddp.module), len(reductions), loss.item()))
    buffer = io.BytesIO()
    torch.save(results, buffer)
    return buffer.getvalue()



def test_over_two_ddp_ranks_with_unequal_negatives_the_plain_ddp_steps_gradients_reduced_once():
    import io

    from tests.dist_utils import run_group
    for rank, out in enumerate(run_group(_ddp_on_ranks, 2, timeout=300)):
        (ours, our_reductions, our_loss), (plain, plain_reductions, plain_loss) = torch.load(io.BytesIO(out))
        difference = max_relative_difference(ours, plain)
        print(f"  rank {rank}: gradients {difference:.3g}, reductions {our_reductions} / {plain_reductions}")
        assert difference <= 1e-10 and abs(our_loss - plain_loss) <= 1e-10 * abs(plain_loss)
        assert our_reductions == plain_reductions >= 1
