"""clip_loss / ClipLoss on one device beyond the diagonal (sample ids with targets "mask" / "multi",
hard negatives, direction) against the materialised fp64 reference (tests/references/clip_targets.py):
loss and the gradients of image, text, hard negatives, logit_scale and logit_bias."""
import pytest
import torch

import clipshard
from tests.comparisons import GRADIENT_NAMES, assert_all_within
from tests.parallel.distinct_ids_bits import distinct_ids_mismatches
from tests.references.clip_targets import clip_targets_reference

M, D, H = 13, 19, 5
ALGORITHMS = ["auto", "torch"]
BIAS_FLOOR = {"bias": 1.0}  # d bias of a softmax row is exactly zero without masks: compare it in absolute terms


def _batch(dtype, seed, m=M, h=H):
    gen = torch.Generator().manual_seed(seed)
    normal = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    image = torch.nn.functional.normalize(normal(m, D), dim=1)
    text = torch.nn.functional.normalize(normal(m, D) + 0.5 * image, dim=1)
    negatives = torch.nn.functional.normalize(normal(h, D) + 0.3 * text[:h], dim=1)
    # ids with repeats: groups of 1, 2 and 3 pairs, in a shuffled order
    ids = torch.randint(0, m // 2, (m,), generator=gen) * 7 + 1000
    return image.to(dtype), text.to(dtype), negatives.to(dtype), ids


def _grads(loss_fn, image, text, negatives, scale, bias, upstream=0.37):
    """(loss, d image, d text, d negatives, d scale, d bias) in fp64 after backward(upstream)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (image, text, negatives, scale, bias)]
    loss = loss_fn(*leaves)
    wrt = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(loss * upstream, wrt, allow_unused=True))
    out = [loss.detach().double()]
    for t in leaves:
        g = None if t is None else next(grads)
        out.append(None if t is None else (torch.zeros_like(t) if g is None else g).double())
    return out


CASES = [(targets, direction, with_negatives, bias)
         for targets in ("mask", "multi") for direction in ("both", "image_to_text")
         for with_negatives in (False, True) for bias in (None, -2.5)]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_matches_the_materialised_reference(dtype, tol, algorithm):
    image, text, negatives, ids = _batch(dtype, seed=1)
    for targets, direction, with_negatives, bias_value in CASES:
        negs = negatives if with_negatives else None
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        scale = torch.tensor(30.0, dtype=acc)
        bias = None if bias_value is None else torch.tensor(bias_value, dtype=acc)
        case = f"{dtype} {algorithm} targets={targets} direction={direction} negatives={with_negatives} bias={bias}"

        def ours(i, t, h, s, b):
            return clipshard.clip_loss(i, t, s, b, algorithm=algorithm, direction=direction, hard_negatives=h,
                                       sample_ids=ids, targets=targets)

        def reference(i, t, h, s, b):
            return clip_targets_reference(i, t, s, b, ids, targets, h, direction)

        want = _grads(reference, image.double(), text.double(), None if negs is None else negs.double(),
                      scale.double(), None if bias is None else bias.double())
        assert_all_within(_grads(ours, image, text, negs, scale, bias), want, tol, case, BIAS_FLOOR)


def test_targets_default_to_mask_and_the_module_takes_the_options():
    image, text, negatives, ids = _batch(torch.float64, seed=2)
    scale = torch.tensor(20.0, dtype=torch.float64)
    default = clipshard.clip_loss(image, text, scale, sample_ids=ids, hard_negatives=negatives)
    mask = clipshard.clip_loss(image, text, scale, sample_ids=ids, targets="mask", hard_negatives=negatives)
    assert torch.equal(default, mask)
    module = clipshard.ClipLoss(direction="image_to_text")
    got = module(image, text, scale, output_dict=True, sample_ids=ids, targets="multi", hard_negatives=negatives)
    want = clip_targets_reference(image, text, scale, None, ids, "multi", negatives, "image_to_text")
    assert set(got) == {"contrastive_loss"}
    assert abs(got["contrastive_loss"].item() - want.item()) < 1e-12 * abs(want.item())


@pytest.mark.parametrize("targets", ["mask", "multi"])
def test_all_ids_equal(targets):
    """One id for the whole batch: "mask" leaves each row its own pair (and the hard negatives) only,
    "multi" makes every pair a positive."""
    image, text, negatives, _ = _batch(torch.float64, seed=3)
    ids = torch.full((M,), 5, dtype=torch.int64)
    scale, bias = torch.tensor(14.0, dtype=torch.float64), torch.tensor(-1.0, dtype=torch.float64)
    want = _grads(lambda i, t, h, s, b: clip_targets_reference(i, t, s, b, ids, targets, h), image, text, negatives,
                  scale, bias)
    got = _grads(lambda i, t, h, s, b: clipshard.clip_loss(i, t, s, b, hard_negatives=h, sample_ids=ids,
                                                          targets=targets), image, text, negatives, scale, bias)
    assert_all_within(got, want, 1e-10, f"all ids equal, {targets}", BIAS_FLOOR)
    if targets == "mask":  # by hand: row i's LSE over S_ii and the negatives
        logits = scale * image @ text.T + bias
        extra = scale * image @ negatives.T + bias
        rows = torch.logsumexp(torch.cat([logits.diag()[:, None], extra], 1), 1) - logits.diag()
        assert abs(got[0].item() - rows.mean().item() / 2) < 1e-12  # each column's term is zero


def test_all_ids_distinct_give_the_bits_of_no_ids():
    """Distinct ids exclude nothing and make the own pair the only positive: both targets give the
    call without ids bit for bit (same algorithm), for every loss, mode and option in one process
    (tests/parallel/test_clip_targets_distributed.py: on 2 and 3 ranks)."""
    mismatches = distinct_ids_mismatches(0, 1, (M,), (3,))
    assert not mismatches, "\n".join(mismatches)


def test_without_the_options_the_loss_is_unchanged():
    """direction="both", no ids, no (or zero) hard negatives: today's bits."""
    image, text, negatives, _ = _batch(torch.float32, seed=5)
    scale, bias = torch.tensor(25.0), torch.tensor(0.5)
    base = _grads(lambda i, t, h, s, b: clipshard.clip_loss(i, t, s, b), image, text, None, scale, bias)
    explicit = _grads(lambda i, t, h, s, b: clipshard.clip_loss(i, t, s, b, direction="both", hard_negatives=h,
                                                               sample_ids=None, targets=None),
                      image, text, None, scale, bias)
    none = _grads(lambda i, t, h, s, b: clipshard.ClipLoss()(i, t, s, b), image, text, None, scale, bias)
    for a, b, c in zip(base, explicit, none):
        assert (a is None and b is None) or (torch.equal(a, b) and torch.equal(a, c))
    empty = _grads(lambda i, t, h, s, b: clipshard.clip_loss(i, t, s, b, algorithm="torch", hard_negatives=h),
                   image, text, negatives[:0], scale, bias)
    torch_path = _grads(lambda i, t, h, s, b: clipshard.clip_loss(i, t, s, b, algorithm="torch"),
                        image, text, None, scale, bias)
    for k in (0, 1, 2, 4, 5):
        assert torch.equal(empty[k], torch_path[k]), GRADIENT_NAMES[k]
    assert empty[3].shape == (0, D)


def test_bad_options_name_the_argument():
    image, text, negatives, ids = _batch(torch.float32, seed=6)
    scale = torch.tensor(10.0)
    cases = [
        (dict(sample_ids=ids[:-1]), ValueError, r"clip_loss: sample_ids must be None or a 1-D int64 tensor .* got a "
                                                r"1-D torch.int64 tensor of shape \(12,\)"),
        (dict(sample_ids=ids.int()), ValueError, r"sample_ids must be .* got a 1-D torch.int32 tensor"),
        (dict(sample_ids=ids[:, None]), ValueError, r"sample_ids must be .* got a 2-D torch.int64"),
        (dict(sample_ids=ids.to("meta")), ValueError, r"sample_ids must be .* on meta \(local batch 13 on cpu\)"),
        (dict(targets="mask"), ValueError, r"clip_loss: targets needs sample_ids"),
        (dict(sample_ids=ids, targets="both"), ValueError, r"targets must be None, 'mask' or 'multi', got 'both'"),
        (dict(direction="text_to_image"), ValueError, r"direction must be 'both' or 'image_to_text'"),
        (dict(hard_negatives=negatives[:, :-1]), ValueError, r"hard_negatives must be .* shape \(5, 18\)"),
        (dict(hard_negatives=negatives.double()), ValueError, r"hard_negatives must be .* torch.float64"),
        (dict(hard_negatives=negatives[0]), ValueError, r"hard_negatives must be .* got a 1-D"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            clipshard.clip_loss(image, text, scale, **kwargs)
    with pytest.raises(ValueError, match=r"ClipLoss: direction must be 'both' or 'image_to_text', got 'rows'"):
        clipshard.ClipLoss(direction="rows")
    with pytest.raises(ValueError, match=r"ClipLoss: targets needs sample_ids"):
        clipshard.ClipLoss()(image, text, scale, targets="multi")
