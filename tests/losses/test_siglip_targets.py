"""siglip_loss / SigLipLoss on one device with sample ids (targets "multi" / "mask") and hard negatives,
against the fp64 materialised reference (tests/references/siglip_targets.py): loss and the gradients of
the image, text and hard-negative features, logit_scale and logit_bias, with the compiled op and the
torch path. Each labelled case first checks that dropping the labels by id would change the reference
by far more than the tolerance, so that the comparison can fail."""
import pytest
import torch

import clipshard
from tests.comparisons import assert_all_within, max_relative_error
from tests.references.siglip_targets import siglip_targets_loss_reference

ALGORITHMS = ["auto", "torch"]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}  # relative to the largest reference value
# ids with repeats (the own pair's id shared with other rows) and a unique one
IDS = torch.tensor([3, 1, 3, 0, 1, 5, 3, 9, 1])


def _features(m, h, dim, seed, dtype):
    gen = torch.Generator().manual_seed(seed)

    def unit(n):
        return torch.nn.functional.normalize(torch.randn(n, dim, generator=gen, dtype=torch.float64), dim=1)

    image = unit(m)
    text = torch.nn.functional.normalize(unit(m) + 0.5 * image, dim=1)  # correlated pairs
    negatives = torch.nn.functional.normalize(unit(h) + 0.3 * image[torch.arange(h) % m], dim=1)  # hard ones
    return image.to(dtype), text.to(dtype), negatives.to(dtype)


def _run(loss_fn, image, text, negatives, scale, bias, upstream, **kwargs):
    """(loss, d image, d text, d negatives, d scale, d bias) after backward(upstream)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (image, text, negatives, scale, bias)]
    loss = loss_fn(leaves[0], leaves[1], leaves[3], leaves[4], hard_negatives=leaves[2], **kwargs)
    (loss * upstream).backward()
    return [loss.detach()] + [None if t is None else t.grad for t in leaves]


def _reference(image, text, negatives, scale, bias, upstream, **kwargs):
    leaves = [None if t is None else t.detach().double().requires_grad_()
              for t in (image, text, negatives, scale, bias)]
    loss = siglip_targets_loss_reference(leaves[0], leaves[1], leaves[3], leaves[4], hard_negatives=leaves[2], **kwargs)
    (loss * upstream).backward()
    return [loss.detach()] + [None if t is None else t.grad for t in leaves]


def _labels_matter(want, without_ids, tol):
    """The check can fail: the reference without the labels by id is far from the one with them."""
    assert max(max_relative_error(a, b) for a, b in zip(without_ids, want) if b is not None) > 100 * tol


CASES = [  # (dtype, scale, bias, hard negatives)
    (torch.float64, 10.0, -10.0, 4), (torch.float64, 100.0, 3.0, 0), (torch.float64, 1.0, None, 5),
    (torch.float32, 10.0, -10.0, 3), (torch.float32, 30.0, 0.5, 0), (torch.float32, 100.0, -5.0, 6),
]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("targets", [None, "multi", "mask"])
@pytest.mark.parametrize("dtype, scale_value, bias_value, h", CASES)
def test_matches_fp64_reference(algorithm, targets, dtype, scale_value, bias_value, h):
    image, text, negatives = _features(IDS.numel(), h, 13, seed=h + int(scale_value), dtype=dtype)
    negatives = negatives if h else None
    scale = torch.tensor(scale_value, dtype=dtype)
    bias = None if bias_value is None else torch.tensor(bias_value, dtype=dtype)
    upstream = 0.5 / IDS.numel()
    want = _reference(image, text, negatives, scale, bias, upstream, sample_ids=IDS, targets=targets)
    _labels_matter(want, _reference(image, text, negatives, scale, bias, upstream), TOLERANCE[dtype])
    case = f"{dtype} targets={targets} scale={scale_value} bias={bias_value} H={h} algorithm={algorithm}"
    for loss_fn in (lambda *a, **k: clipshard.siglip_loss(*a, algorithm=algorithm, **k),
                    clipshard.SigLipLoss(algorithm=algorithm)):
        got = _run(loss_fn, image, text, negatives, scale, bias, upstream, sample_ids=IDS, targets=targets)
        assert_all_within(got, want, TOLERANCE[dtype], case)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_all_ids_equal(algorithm, dtype):
    """One id for the whole batch: "multi" makes every pair a positive, "mask" leaves only the own
    pairs (closed forms, independent of the reference's labels)."""
    m, h = 6, 3
    image, text, negatives = _features(m, h, 9, seed=5, dtype=dtype)
    scale, bias = torch.tensor(10.0, dtype=dtype), torch.tensor(-2.0, dtype=dtype)
    ids = torch.full((m,), 7)
    softplus = lambda t: -torch.nn.functional.logsigmoid(-t)  # noqa: E731  (exact in fp64, unlike torch's softplus)
    logits = scale.double() * image.double() @ text.double().T + bias.double()
    extra = softplus(scale.double() * image.double() @ negatives.double().T + bias.double()).sum()
    closed = {"multi": (softplus(-logits).sum() + extra) / m, "mask": (softplus(-logits.diagonal()).sum() + extra) / m}
    without_ids = clipshard.siglip_loss(image, text, scale, bias, hard_negatives=negatives, algorithm=algorithm)
    for targets, want in closed.items():
        assert max_relative_error(without_ids, want) > 100 * TOLERANCE[dtype]  # the ids must change the loss
        got = clipshard.siglip_loss(image, text, scale, bias, hard_negatives=negatives, sample_ids=ids,
                                    targets=targets, algorithm=algorithm)
        assert max_relative_error(got, want) <= TOLERANCE[dtype], (targets, got, want)
        full = _run(lambda *a, **k: clipshard.siglip_loss(*a, algorithm=algorithm, **k), image, text, negatives,
                    scale, bias, 0.25, sample_ids=ids, targets=targets)
        reference = _reference(image, text, negatives, scale, bias, 0.25, sample_ids=ids, targets=targets)
        assert_all_within(full, reference, TOLERANCE[dtype], f"all ids equal, {targets}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("h", [0, 4])
def test_all_ids_distinct_is_the_loss_without_ids(algorithm, h):
    """Distinct ids give no pair but the own one a +1 and drop none: both targets are the loss without
    ids (a path that mislabels distinct ids fails here)."""
    m = 8
    image, text, negatives = _features(m, h, 11, seed=9, dtype=torch.float64)
    negatives = negatives if h else None
    scale, bias = torch.tensor(20.0, dtype=torch.float64), torch.tensor(-6.0, dtype=torch.float64)
    ids = torch.randperm(m, generator=torch.Generator().manual_seed(3)) * 5 - 11
    loss_fn = lambda *a, **k: clipshard.siglip_loss(*a, algorithm=algorithm, **k)  # noqa: E731
    want = _run(loss_fn, image, text, negatives, scale, bias, 0.5 / m)
    for targets in ("multi", "mask"):
        got = _run(loss_fn, image, text, negatives, scale, bias, 0.5 / m, sample_ids=ids, targets=targets)
        assert_all_within(got, [w.double() if w is not None else None for w in want], 1e-12, f"distinct ids, {targets}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_empty_hard_negatives_are_no_hard_negatives(algorithm):
    image, text, negatives = _features(5, 0, 7, seed=2, dtype=torch.float32)
    scale, bias = torch.tensor(10.0), torch.tensor(-10.0)
    want = clipshard.siglip_loss(image, text, scale, bias, algorithm=algorithm)
    got = clipshard.siglip_loss(image, text, scale, bias, hard_negatives=negatives, algorithm=algorithm)
    assert max_relative_error(got, want.double()) <= 1e-6


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_without_ids_and_negatives_the_loss_is_todays(algorithm):
    """No hard_negatives / sample_ids: the old code path, bit for bit (siglip_sum of the block / M)."""
    image, text, _ = _features(7, 0, 5, seed=4, dtype=torch.float32)
    scale, bias = torch.tensor(10.0), torch.tensor(-10.0)
    want = clipshard.siglip_sum(image, text, scale, bias, 0, algorithm=algorithm) / 7
    for got in (clipshard.siglip_loss(image, text, scale, bias, algorithm=algorithm),
                clipshard.SigLipLoss(algorithm=algorithm)(image, text, scale, bias),
                clipshard.siglip_loss(image, text, scale, bias, hard_negatives=None, sample_ids=None, targets=None,
                                      algorithm=algorithm)):
        assert torch.equal(got, want)


def test_output_dict():
    image, text, negatives = _features(5, 2, 7, seed=6, dtype=torch.float64)
    ids = torch.tensor([0, 1, 0, 2, 1])
    scale, bias = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-3.0, dtype=torch.float64)
    got = clipshard.SigLipLoss()(image, text, scale, bias, output_dict=True, hard_negatives=negatives, sample_ids=ids)
    want = siglip_targets_loss_reference(image, text, scale, bias, sample_ids=ids, hard_negatives=negatives)
    assert set(got) == {"contrastive_loss"} and max_relative_error(got["contrastive_loss"], want) <= 1e-10


def test_bad_arguments_name_the_argument():
    image, text, negatives = _features(4, 2, 3, seed=1, dtype=torch.float32)
    ids = torch.arange(4)
    calls = {
        "targets": lambda: clipshard.siglip_loss(image, text, 10.0, targets="multi"),
        "targets ": lambda: clipshard.siglip_loss(image, text, 10.0, sample_ids=ids, targets="both"),
        "sample_ids": lambda: clipshard.siglip_loss(image, text, 10.0, sample_ids=ids[:3]),
        "sample_ids ": lambda: clipshard.siglip_loss(image, text, 10.0, sample_ids=ids.float()),
        "hard_negatives": lambda: clipshard.siglip_loss(image, text, 10.0, hard_negatives=negatives[:, :2]),
        "hard_negatives ": lambda: clipshard.siglip_loss(image, text, 10.0, hard_negatives=negatives.double()),
    }
    for name, call in calls.items():
        with pytest.raises((TypeError, ValueError), match=name.strip()):
            call()
