"""A bad input that only one rank sees raises on every rank, within seconds, never a hang.

Each case gives rank 1 (or every rank) something that would make it fail after the metadata
exchange, runs the loss on real 2-process gloo groups and requires an error on every rank,
quickly, with the group still usable afterwards (nobody left inside a collective). A hang would
end in gloo's collective timeout (a RuntimeError after 30 s), which fails the case.
"""
import time

import pytest
import torch
import torch.distributed as dist

import clipshard
from tests.dist_utils import run_group

SECONDS = 10  # far below the collective timeout: an error must come from the exchange itself


def _features(rank, dim=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(rank)
    return [(torch.randint(-8, 9, (4, dim), generator=gen) / 8).to(dtype) for _ in range(2)]


def _inputs(rank, case):
    """(image, text, scale, bias) of `rank` for one case; only rank 1 is bad unless the case says all."""
    image, text = _features(rank)
    scale, bias = torch.tensor(10.0), torch.tensor(-1.0)
    bad = rank == 1
    if case == "integer logit_scale" and bad:
        scale = torch.tensor(10)
    elif case == "integer logit_bias" and bad:
        bias = torch.tensor(-1)
    elif case == "logit_scale dtype differs" and bad:
        scale = scale.double()
    elif case == "logit_bias dtype differs" and bad:
        bias = bias.half()
    elif case == "logit_scale requires grad on one rank" and bad:
        scale = scale.requires_grad_()
    elif case == "logit_scale with two elements" and bad:
        scale = torch.tensor([10.0, 11.0])
    elif case == "features on the meta device" and bad:
        image, text = image.to("meta"), text.to("meta")
    elif case == "sparse features" and bad:
        image = image.to_sparse()
    elif case == "features are not tensors" and bad:
        image = image.tolist()
    elif case == "empty feature dimension (every rank)":
        image, text = image[:, :0], text[:, :0]
    return image, text, scale, bias


CASES = ["integer logit_scale", "integer logit_bias", "logit_scale dtype differs", "logit_bias dtype differs",
         "logit_scale requires grad on one rank", "logit_scale with two elements", "features on the meta device",
         "sparse features", "features are not tensors", "empty feature dimension (every rank)",
         "no_grad on one rank"]


def _loss_calls():
    yield "clip_loss exchange", lambda *a: clipshard.clip_loss(*a, local_loss=True)
    yield "clip_loss local", lambda *a: clipshard.clip_loss(*a, local_loss=False, mode="local")
    yield "clip_loss ring", lambda *a: clipshard.clip_loss(*a, local_loss=True, mode="ring")
    yield "ClipLoss", lambda *a: clipshard.ClipLoss(True, True, rank=dist.get_rank(), world_size=2)(*a)


def _every_case_raises(rank, world_size):
    report = {}
    for case in CASES:
        for name, call in _loss_calls():
            image, text, scale, bias = _inputs(rank, case)
            if isinstance(image, torch.Tensor) and image.layout == torch.strided and image.device.type == "cpu":
                image.requires_grad_()
            started = time.monotonic()
            try:
                if case == "no_grad on one rank" and rank == 1:
                    with torch.no_grad():
                        call(image, text, scale, bias)
                else:
                    call(image, text, scale, bias)
                outcome = "no error"
            except (ValueError, TypeError) as error:
                outcome = type(error).__name__ + ": " + str(error)
            seconds = time.monotonic() - started
            report[case, name] = (outcome, seconds)
            probe = torch.ones(1)  # the group still works: nobody is waiting in a collective
            dist.all_reduce(probe)
            assert probe.item() == world_size
    return report


def test_a_bad_input_on_one_rank_raises_on_every_rank_within_seconds():
    reports = run_group(_every_case_raises, 2, timeout=300)
    failures = []
    for key, (outcome, seconds) in reports[0].items():
        for rank, report in enumerate(reports):
            outcome, seconds = report[key]
            if outcome == "no error" or seconds > SECONDS:
                failures.append(f"{key} on rank {rank}: {outcome} after {seconds:.1f} s")
    assert not failures, "\n".join(failures)


def test_the_error_names_the_problem_and_the_rank():
    def run(rank, world_size):
        image, text, scale, bias = _inputs(rank, "integer logit_scale")
        with pytest.raises((TypeError, ValueError)) as error:
            clipshard.clip_loss(image, text, scale, bias)
        return str(error.value)

    messages = run_group(run, 2, timeout=60)
    assert "logit_scale must be a fp32, fp16, bf16 or fp64 tensor, got torch.int64 (on rank 1)" in messages[1]
    assert "rank 1 has invalid inputs: logit_scale must be a fp32, fp16, bf16 or fp64 tensor, got torch.int64" \
        in messages[0]


def _every_loss(rank, image, text, teacher, ids=None):
    """Each loss and mode on (image, text), by name."""
    extras = {} if ids is None else {"sample_ids": ids}
    return {
        "ClipLoss exchange": lambda: clipshard.ClipLoss(True, True, rank=rank, world_size=2)(image, text, 10.0, **extras),
        "ClipLoss local": lambda: clipshard.ClipLoss(True, False, rank=rank, world_size=2)(image, text, 10.0, **extras),
        "ClipLoss ring": lambda: clipshard.ClipLoss(True, True, rank=rank, world_size=2, mode="ring")(
            image, text, 10.0, **extras),
        "SigLipLoss gather": lambda: clipshard.SigLipLoss(rank=rank, world_size=2)(image, text, 10.0, -1.0, **extras),
        "SigLipLoss ring": lambda: clipshard.SigLipLoss(rank=rank, world_size=2, mode="ring")(
            image, text, 10.0, -1.0, **extras),
        "DistillClipLoss": lambda: clipshard.DistillClipLoss(True, True, rank=rank, world_size=2)(
            image, text, 10.0, *teacher, 20.0),
    }


def _what_rank_1_passed(rank, world_size):
    """Issue 40 item 8: per (case, loss), the message of each rank when rank 1 passes something bad."""
    messages = {}
    for case in ("int64 features", "sample_ids of the wrong length", "teacher of another batch"):
        image, text = _features(rank)
        teacher, ids = (image, text), None
        if case == "int64 features" and rank == 1:
            image, text = image.long(), text.long()
        elif case == "sample_ids of the wrong length":
            ids = torch.arange(4 * rank, 4 * rank + (3 if rank == 1 else 4))
        elif case == "teacher of another batch" and rank == 1:
            teacher = (image[:3], text[:3])
        for name, call in _every_loss(rank, image, text, teacher, ids).items():
            if case == "sample_ids of the wrong length" and name == "DistillClipLoss":
                continue  # it takes no sample_ids
            if case == "teacher of another batch" and name != "DistillClipLoss":
                continue
            with pytest.raises((TypeError, ValueError)) as error:
                call()
            messages[case, name] = str(error.value)
    return messages


# what rank 1 passed, as every rank's message must name it
PASSED = {"int64 features": "got torch.int64",
          "sample_ids of the wrong length": "got a 1-D torch.int64 tensor of shape (3,)",
          "teacher of another batch": "must be the student's (4 rows), got 3"}


def test_the_other_ranks_say_what_the_bad_rank_passed():
    """Issue 40 item 8: rank 0's message quotes rank 1's (int64 features on SigLipLoss's ring named
    only the rule, not int64), for every loss and mode."""
    messages = run_group(_what_rank_1_passed, 2, timeout=120)
    for (case, name), own in messages[1].items():
        other = messages[0][case, name]
        assert PASSED[case] in own and "(on rank 1)" in own, (case, name, own)
        assert "rank 1 has invalid inputs: " in other and PASSED[case] in other, (case, name, other)
        assert own.split(": ", 1)[1].removesuffix(" (on rank 1)") in other, (case, name, own, other)


def test_mismatched_dtypes_name_every_rank():
    def run(rank, world_size):
        image, text, scale, bias = _inputs(rank, "logit_bias dtype differs")
        with pytest.raises(ValueError) as error:
            clipshard.clip_loss(image, text, scale, bias)
        return str(error.value)

    for message in run_group(run, 2, timeout=60):
        assert "all ranks must use the same logit_bias dtype, got rank 0: torch.float32, rank 1: torch.float16" in message


def test_one_element_logit_scale_and_bias_work_on_a_group():
    """Shape (1,) (open_clip's nonscalar_logit_scale) gives the same loss as 0-dim, and gradients of
    shape (1,)."""
    def run(rank, world_size):
        image, text = _features(rank)
        results = []
        for shape in ((), (1,)):
            scale = torch.full(shape, 10.0, requires_grad=True)
            bias = torch.full(shape, -1.0, requires_grad=True)
            loss = clipshard.clip_loss(image, text, scale, bias, local_loss=False)
            loss.backward()
            assert scale.grad.shape == shape and bias.grad.shape == shape
            results.append((loss.detach(), scale.grad.reshape(()), bias.grad.reshape(())))
        return all(torch.equal(a, b) for a, b in zip(*results))

    assert run_group(run, 2, timeout=60) == [True, True]


def _meta_features_rank(rank, world_size):
    """Issue 31 item 7 (a regression): rank 1's features and scales on the meta device, the scales
    as Python numbers or meta tensors. The scales' values ride on the metadata row, and copying
    them out of a meta tensor killed rank 1 ("Cannot copy out of meta tensor") while the others got
    gloo's "Connection closed by peer". Now every rank raises the device error, for every loss and
    mode (the same row carries SigLIP's and the distillation's scales, the teachers' too)."""
    image, text = _features(rank)
    device = "meta" if rank == 1 else "cpu"
    image, text = image.to(device), text.to(device)
    teacher = torch.randn(4, 6).to(device)
    calls = {
        "clip_loss exchange": lambda: clipshard.clip_loss(image, text, 10.0, local_loss=True),
        "clip_loss ring": lambda: clipshard.clip_loss(image, text, torch.tensor(10.0, device=device), mode="ring"),
        "siglip_loss gather": lambda: clipshard.siglip_loss(image, text, 10.0, -1.0),
        "siglip_loss ring": lambda: clipshard.siglip_loss(image, text, 10.0, -1.0, mode="ring"),
        "DistillClipLoss exchange": lambda: clipshard.DistillClipLoss(True, True, rank=rank, world_size=2)(
            image, text, 10.0, teacher, teacher, 20.0),
        "DistillClipLoss ring": lambda: clipshard.DistillClipLoss(True, True, rank=rank, world_size=2, mode="ring")(
            image, text, 10.0, teacher, teacher, 20.0),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="all ranks must use the same feature device type, got rank 0: cpu, "
                                             "rank 1: meta"):
            call()
        probe = torch.ones(1)  # the group still works: nobody is waiting in a collective
        dist.all_reduce(probe)
        assert probe.item() == world_size, name
    return True


def test_features_on_the_meta_device_on_one_rank_raise_the_device_error_on_every_rank():
    assert run_group(_meta_features_rank, 2, timeout=120) == [True, True]
