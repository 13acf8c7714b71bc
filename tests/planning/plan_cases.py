"""The cases of the planner's validation (tests/planning/test_plan_matches_measured.py): each is one
loss call (loss, mode, options, dtype, extras) that is planned with clipshard.plan_memory and then
run for real on gloo ranks, its peak measured with measured_peak_bytes.

The real call mirrors what the planner runs (clipshard/planning/loss_plan.py): the features, hard
negatives and logit_scale (SigLIP: and logit_bias) are leaves that require grad, made before the
call; the teacher's features and scale carry no grad; sample ids are global int64 ids; the call is
the forward and the backward of the loss (DistillClipLoss: of its two terms' sum).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

import clipshard
from clipshard.parallel.collectives import gather_rows
from clipshard.parallel.layout import ShardLayout
from clipshard.planning import plan_memory
from clipshard.planning.allocation_tracker import AllocationTracker
from clipshard.planning.fake_world import fake_world
from clipshard.planning.measured_peak import measured_peak_bytes

# MiBs of loss memory per rank (the features' gradients alone are 1.2 MiB), so that the tolerance's
# 256 KiB is small beside them; odd sizes; a batch small enough for the time (the work per rank grows
# as N M^2 D).
BATCH, DIM, NEGATIVES, TEACHER_DIM = 613, 253, 301, 97
REPEATS = 2  # gloo frees its buffers at varying times: the smaller of two measurements counts (measure)
TOLERANCE_FRACTION, TOLERANCE_BYTES = 0.10, 256 << 10

_LOSSES = {"clip": clipshard.ClipLoss, "siglip": clipshard.SigLipLoss, "distill": clipshard.DistillClipLoss}


@dataclass(frozen=True)
class Case:
    """One planned call. options: the loss constructor's keyword arguments, as (name, value) pairs."""

    name: str
    loss: str
    options: tuple = ()
    dtype: torch.dtype = torch.float32
    hard_negatives: int = 0
    sample_ids: bool = False
    targets: str = None
    teacher_dim: int = None
    alone_too: bool = True  # False: alone (a world of 1) it runs another case's code

    def make_loss(self, rank=0, world_size=1):
        return _LOSSES[self.loss](rank=rank, world_size=world_size, **dict(self.options))

    def runs_in(self, world_size):
        return world_size > 1 or self.alone_too

    def plan(self, world_size):
        return plan_memory(self.make_loss(), world_size=world_size, batch_size=BATCH, dim=DIM, dtype=self.dtype,
                           hard_negatives=self.hard_negatives, sample_ids=self.sample_ids, targets=self.targets,
                           device="cpu", teacher_dim=self.teacher_dim)

    def measure(self, rank, world_size):
        """The smallest of REPEATS measured peaks of the real call on this rank (of `world_size`).
        gloo's worker thread drops its references to a collective's tensors at a time of its own,
        at times after the program's next allocation (one block more on one rank, run to run):
        the smallest peak is the program's own, which the plan counts; that extra never lowers it."""
        loss = self.make_loss(rank, world_size)
        call, leaves = self._real_call(loss, rank)
        peaks = []
        for _ in range(REPEATS):
            for leaf in leaves:
                leaf.grad = None  # a gradient left from the last repeat would be accumulated in place
            peaks.append(measured_peak_bytes(call, "cpu"))
        return min(peaks)

    def _real_call(self, loss, rank):
        """(call, the leaves that get gradients) with this rank's random inputs."""
        generator = torch.Generator().manual_seed(1000 + rank)

        def features(rows, dim=DIM, requires_grad=True):
            x = torch.randn(rows, dim, generator=generator, dtype=torch.float64)
            return torch.nn.functional.normalize(x, dim=1).to(self.dtype).requires_grad_(requires_grad)

        image, text = features(BATCH), features(BATCH)
        scale = torch.tensor(14.3).requires_grad_()
        leaves = [image, text, scale]
        if self.loss == "distill":
            teacher_dim = self.teacher_dim or DIM
            teacher = (features(BATCH, teacher_dim, False), features(BATCH, teacher_dim, False), torch.tensor(20.0))
            return lambda: sum(loss(image, text, scale, *teacher)).backward(), leaves
        extras = {}
        if self.hard_negatives:
            extras["hard_negatives"] = features(self.hard_negatives)
            leaves.append(extras["hard_negatives"])
        if self.sample_ids:  # global ids, three pairs per id (some across the ranks' boundaries)
            extras["sample_ids"] = (torch.arange(BATCH) + rank * BATCH) // 3
            extras["targets"] = self.targets
        if self.loss == "siglip":
            bias = torch.tensor(-10.0).requires_grad_()
            leaves.append(bias)
            return lambda: loss(image, text, scale, bias, **extras).backward(), leaves
        return lambda: loss(image, text, scale, **extras).backward(), leaves


def within_tolerance(planned, measured):
    return abs(planned - measured) <= TOLERANCE_FRACTION * measured + TOLERANCE_BYTES


def _cases():
    exchange, ring = (("gather_with_grad", True),), (("gather_with_grad", True), ("mode", "ring"))
    local_loss = (("local_loss", True),)
    ids, bf16 = {"sample_ids": True}, {"dtype": torch.bfloat16}
    modes = {"alone_too": False}  # a mode (or local_loss) variant: alone, the loss ignores its mode
    yield Case("clip exchange", "clip", exchange)
    yield Case("clip exchange local_loss", "clip", exchange + local_loss, **modes)
    yield Case("clip local", "clip", local_loss, **modes)
    yield Case("clip local global_loss", "clip", **modes)
    yield Case("clip ring", "clip", ring, **modes)
    yield Case("clip ring local_loss", "clip", ring + local_loss, **modes)
    yield Case("clip exchange negatives", "clip", exchange, hard_negatives=NEGATIVES)
    yield Case("clip ring negatives", "clip", ring, hard_negatives=NEGATIVES, **modes)
    yield Case("clip local negatives", "clip", local_loss, hard_negatives=NEGATIVES, **modes)
    for targets in ("mask", "multi"):
        yield Case(f"clip exchange ids {targets}", "clip", exchange, targets=targets, **ids)
        yield Case(f"clip ring ids {targets}", "clip", ring, targets=targets, **ids, **modes)
    yield Case("clip local ids mask", "clip", local_loss, targets="mask", **ids, **modes)
    yield Case("clip exchange image_to_text", "clip", exchange + (("direction", "image_to_text"),))
    yield Case("clip ring image_to_text", "clip", ring + (("direction", "image_to_text"),), **modes)
    yield Case("clip exchange all extras", "clip", exchange + (("direction", "image_to_text"),),
               hard_negatives=NEGATIVES, targets="multi", **ids)
    yield Case("clip exchange chunked", "clip", exchange + (("algorithm", "chunked"),))
    yield Case("clip exchange torch", "clip", exchange + (("algorithm", "torch"),))
    yield Case("clip ring torch", "clip", ring + (("algorithm", "torch"),), **modes)
    yield Case("clip ring on_change", "clip", ring + (("validate", "on_change"),), **modes)
    yield Case("clip exchange bf16", "clip", exchange, **bf16)
    yield Case("clip local bf16", "clip", local_loss, **bf16, **modes)
    yield Case("clip ring bf16", "clip", ring, **bf16, **modes)
    yield Case("clip ring negatives ids bf16", "clip", ring, hard_negatives=NEGATIVES, targets="mask", **ids, **bf16)
    yield Case("clip exchange fp16", "clip", exchange, dtype=torch.float16)
    yield Case("clip ring fp16", "clip", ring, dtype=torch.float16, **modes)

    gather, siglip_ring = (), (("mode", "ring"),)
    yield Case("siglip gather", "siglip", gather)
    yield Case("siglip ring", "siglip", siglip_ring, **modes)
    yield Case("siglip gather negatives", "siglip", gather, hard_negatives=NEGATIVES)
    yield Case("siglip ring negatives", "siglip", siglip_ring, hard_negatives=NEGATIVES, **modes)
    for targets in ("multi", "mask"):
        yield Case(f"siglip gather ids {targets}", "siglip", gather, targets=targets, **ids)
        yield Case(f"siglip ring ids {targets}", "siglip", siglip_ring, targets=targets, **ids, **modes)
    yield Case("siglip gather torch", "siglip", (("algorithm", "torch"),))
    yield Case("siglip ring torch", "siglip", siglip_ring + (("algorithm", "torch"),), **modes)
    yield Case("siglip gather bf16", "siglip", gather, **bf16)
    yield Case("siglip ring negatives ids bf16", "siglip", siglip_ring, hard_negatives=NEGATIVES, **ids, **bf16)
    yield Case("siglip ring fp16", "siglip", siglip_ring, dtype=torch.float16)

    yield Case("distill exchange", "distill", exchange)
    yield Case("distill exchange local_loss", "distill", exchange + local_loss, **modes)
    yield Case("distill local", "distill", local_loss, **modes)
    yield Case("distill local global_loss", "distill", **modes)
    yield Case("distill ring", "distill", ring, **modes)
    yield Case("distill ring local_loss", "distill", ring + local_loss, **modes)
    yield Case("distill exchange teacher_dim", "distill", exchange, teacher_dim=TEACHER_DIM)
    yield Case("distill exchange torch", "distill", exchange + (("algorithm", "torch"),))
    yield Case("distill exchange bf16", "distill", exchange, **bf16)
    yield Case("distill ring bf16", "distill", ring, **bf16, **modes)
    yield Case("distill exchange fp16", "distill", exchange, dtype=torch.float16)


CASES = tuple(_cases())


def gather_and_back(x):
    """The exchange modes' collectives alone, over the default group: every rank's rows of x
    gathered (an all-gather into one tensor), the gradient of their weighted sum reduce-scattered
    back to x (a reduce-scatter of one tensor). The gathered rows stay alive to the end, as a
    loss's saved texts do (gloo's worker may hold them until its next collective anyway)."""
    world_size = dist.get_world_size()
    layout = ShardLayout(sizes=(x.shape[0],) * world_size, rank=dist.get_rank(), group=dist.group.WORLD)
    gathered = gather_rows(x, layout)
    (gathered * 0.5).sum().backward()
    return gathered


def plan_gather(world_size):
    """The planned peak of gather_and_back on a fake group of world_size ranks (a CPU plan)."""
    with fake_world(world_size, "cpu"):
        x = torch.empty(BATCH, DIM).requires_grad_()
        tracker = AllocationTracker("cpu")
        with tracker:
            gather_and_back(x)
    return tracker.peak_bytes


def _measure_gather():
    x = torch.randn(BATCH, DIM).requires_grad_()
    peaks = []
    for _ in range(REPEATS):
        x.grad = None
        peaks.append(measured_peak_bytes(lambda: gather_and_back(x), "cpu"))
    return max(peaks)


def measure_on_rank(rank, world_size):
    """Runs on every rank of a gloo group (tests/dist_utils.run_group): {"cases": {case name:
    measured peak} of the cases for this world size, "gather": gather_and_back's measured peak,
    "refusal": the message of plan_memory's refusal in a process whose default group is
    initialised (None if it planned)}."""
    try:
        CASES[0].plan(max(world_size, 2))  # (a plan for one process needs no process group)
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    return {"cases": {case.name: case.measure(rank, world_size) for case in CASES if case.runs_in(world_size)},
            "gather": _measure_gather(), "refusal": refusal}
