"""The id paths give the same bits when run twice (issue 44, item 3; docs/fused_loss.md, "Determinism"):
every loss with sample ids, both targets, with hard negatives, forward and backward, under
torch.use_deterministic_algorithms(True) (which would refuse a nondeterministic CUDA op) and without it.
On the CPU here; on a GPU (the `cuda` case, run by benchmarks/gpu_check.sh) the same calls print one
line per case with the number of differing bits."""
import pytest
import torch

import clipshard

M, H, D = 37, 5, 24


def _inputs(device, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    unit = lambda n: torch.nn.functional.normalize(torch.randn(n, D, generator=g, dtype=torch.float64), dim=1)  # noqa: E731
    image, text, negatives = (unit(n).to(device, dtype).requires_grad_() for n in (M, M, H))
    ids = torch.randint(0, M // 3, (M,), generator=g).to(device)  # repeats: the id paths matter
    return image, text, negatives, ids


def _call(loss, device, dtype, targets):
    image, text, negatives, ids = _inputs(device, dtype, seed=3)
    scale = torch.tensor(14.0, device=device, requires_grad=True)
    if isinstance(loss, clipshard.SigLipLoss):
        out = loss(image, text, scale, torch.tensor(-2.0, device=device), sample_ids=ids, targets=targets,
                   hard_negatives=negatives)
    else:
        out = loss(image, text, scale, hard_negatives=negatives, sample_ids=ids, targets=targets)
    (out * (0.5 / M)).backward()
    return [out.detach(), image.grad, text.grad, negatives.grad, scale.grad]


CASES = [(loss, targets) for loss in ("ClipLoss", "ClipLoss one direction", "SigLipLoss")
         for targets in ("mask", "multi")]


def _loss(name):
    if name == "SigLipLoss":
        return clipshard.SigLipLoss()
    return clipshard.ClipLoss(direction="image_to_text" if "one direction" in name else "both")


def _differing_bits(first, second):
    return sum(int((a != b).sum()) for a, b in zip(first, second))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name,targets", CASES)
def test_id_paths_give_the_same_bits_twice(device, name, targets):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dtype = torch.float32
    first = _call(_loss(name), device, dtype, targets)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        second = _call(_loss(name), device, dtype, targets)
    finally:
        torch.use_deterministic_algorithms(previous)
    differing = _differing_bits(first, second)
    print(f"determinism {device} {name} targets={targets}: {differing} differing values over two runs")
    assert differing == 0
    assert all(torch.isfinite(t).all() for t in first)
