"""plan_memory of a GradCache training step (clipshard/planning/step_plan.py) against the measured
peak of the real step: a small open_clip CLIP (one vision layer, two text layers, 32 x 32 images),
two steps (GradCache call, backward, optimizer.step(), zero_grad()) from a start where the weights
and the batch exist, on the CPU, in one process and on 2 gloo ranks.

The planned step is the plan's peak minus what it counted as live before the step (weights and
buffers, the batch's inputs), and must be within 10 % + 256 KiB of the measured peak above the
start: |planned - measured| <= 0.10 * measured + 256 KiB."""
import pytest
import torch

open_clip = pytest.importorskip("open_clip", reason="open_clip is not installed: pip install '.[open_clip]'")

import clipshard  # noqa: E402
from clipshard.planning import plan_memory  # noqa: E402
from tests.dist_utils import run_group  # noqa: E402
from tests.planning import two_tower  # noqa: E402

VISION = {"image_size": 32, "layers": 1, "width": 64, "head_width": 16, "patch_size": 8}
TEXT = {"context_length": 16, "vocab_size": 1000, "width": 64, "heads": 4, "layers": 2}
BATCH, MICRO = 22, 4  # six micro-batches, the last one shorter
SLACK_BYTES = 256 << 10
OPTIMIZERS = {"clipshard": lambda p: clipshard.optim.AdamW(p),
              "clipshard-bf16-state": lambda p: clipshard.optim.AdamW(p, state_dtype=torch.bfloat16),
              "torch": lambda p: torch.optim.AdamW(p)}


def _model(device=None, siglip=False):
    with torch.device(device or "cpu"):
        torch.manual_seed(0)
        return open_clip.CLIP(embed_dim=32, vision_cfg=VISION, text_cfg=TEXT, output_dict=True,
                              init_logit_bias=-10.0 if siglip else None)


def _cache(model, siglip=False, parameters_mode=False):
    loss = clipshard.SigLipLoss(mode="ring") if siglip else clipshard.ClipLoss(mode="ring")
    return clipshard.GradCache(model, loss, micro_batch_size=MICRO,
                               parameters=model.parameters() if parameters_mode else None)


def _measured(optimizer, autocast=None, siglip=False, parameters_mode=False):
    """The peak above the start of two real steps, with the weights and the batch allocated before."""
    model = _model(siglip=siglip)
    cache, built = _cache(model, siglip, parameters_mode), OPTIMIZERS[optimizer](model.parameters())
    generator = torch.Generator().manual_seed(1)
    images, texts = torch.randn(BATCH, 3, 32, 32, generator=generator), torch.randint(1, 1000, (BATCH, 16),
                                                                                       generator=generator)

    return two_tower.measured_two_steps(cache, built, images, texts, autocast)


def _planned_step(plan):
    """The plan's peak above what it counted as live before the step (weights, inputs)."""
    return plan.peak_bytes - sum(nbytes for nbytes, _ in plan.counted_before)


def _plan(optimizer, world_size=1, autocast=None, siglip=False, parameters_mode=False):
    return plan_memory(_cache(_model("meta", siglip), siglip, parameters_mode), world_size=world_size,
                       batch_size=BATCH, device="cpu", optimizer=OPTIMIZERS[optimizer], autocast=autocast)


@pytest.fixture(scope="module")
def plan_without_optimizer():
    return plan_memory(_cache(_model("meta")), world_size=1, batch_size=BATCH, device="cpu")


def _assert_close(planned, measured, plan):
    print(f"planned {planned} bytes, measured {measured} bytes ({planned / measured - 1:+.1%})")
    assert abs(planned - measured) <= 0.10 * measured + SLACK_BYTES, plan.table(rows=20)


@pytest.mark.parametrize("optimizer,autocast", [("clipshard", None), ("clipshard-bf16-state", None),
                                                ("torch", None), ("clipshard", torch.bfloat16)])
def test_planned_step_matches_the_measured_step_in_one_process(optimizer, autocast):
    plan = _plan(optimizer, autocast=autocast)
    _assert_close(_planned_step(plan), _measured(optimizer, autocast), plan)


@pytest.mark.parametrize("siglip,parameters_mode", [(True, False), (False, True)],
                         ids=["SigLipLoss", "parameters-mode"])
def test_planned_step_matches_the_measured_step_for_siglip_and_parameters_mode(siglip, parameters_mode):
    plan = _plan("clipshard", siglip=siglip, parameters_mode=parameters_mode)
    _assert_close(_planned_step(plan), _measured("clipshard", siglip=siglip, parameters_mode=parameters_mode), plan)


def test_planned_step_of_a_model_given_inputs_matches_the_measured_step_on_two_ranks():
    """A model that is not open_clip's (its inputs from `inputs=`), the ring loss on 2 gloo ranks."""
    with torch.device("meta"):
        model = two_tower.TwoTower()
    plan = plan_memory(two_tower.cache(model), world_size=2, batch_size=two_tower.BATCH, device="cpu",
                       optimizer="clipshard", inputs=two_tower.inputs)
    for measured in run_group(two_tower.measured_on_rank, 2):
        _assert_close(_planned_step(plan), measured, plan)


def test_a_plan_without_the_optimizer_misses_its_state(plan_without_optimizer):
    """The tolerance is tight enough to see the optimizer's state (twice the weights): a plan that
    leaves the optimizer out is refused by the same check."""
    planned, measured = _planned_step(plan_without_optimizer), _measured("clipshard")
    assert measured - planned > 0.10 * measured + SLACK_BYTES


def test_the_plan_counts_weights_and_inputs_before_and_names_gradients_and_state():
    model = _model()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    plan = plan_memory(_cache(model), world_size=1, batch_size=BATCH, device="cpu", optimizer="clipshard")
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    inputs = BATCH * 3 * 32 * 32 * 4 + BATCH * 16 * 8
    assert [nbytes for nbytes, _ in plan.counted_before] == [weights, inputs]
    kinds = {what: nbytes for nbytes, what, _ in plan.by_kind()}
    params = sum(p.numel() * 4 for p in model.parameters())
    # at the peak (a re-run before the last) every gradient but logit_scale's (the last re-run's) is live
    assert kinds["the parameters' gradients (.grad)"] == params - 4
    assert kinds["the optimizer's state"] == 2 * params + 4 * len(list(model.parameters()))  # moments and steps
    after = model.state_dict()  # the caller's model is left as it was
    assert all(after[name].device.type == "cpu" and torch.equal(after[name], p) for name, p in before.items())


def test_batch_on_device_false_counts_one_micro_batch_copy_instead_of_the_batch(plan_without_optimizer):
    on_device = plan_without_optimizer
    on_host = plan_memory(_cache(_model("meta")), world_size=1, batch_size=BATCH, device="cpu",
                          batch_on_device=False)
    assert len(on_device.counted_before) == 2 and len(on_host.counted_before) == 1
    assert any("aten::clone -> (4, 3, 32, 32) float32" in what for _, what in on_host.peak_allocations)


def test_a_model_factory_is_built_in_the_fake_mode(plan_without_optimizer):
    built = []

    def factory():
        built.append(_model())
        return built[-1]

    plan = plan_memory(_cache(_model("meta")), world_size=1, batch_size=BATCH, device="cpu", model=factory)
    assert isinstance(next(built[0].parameters()), torch._subclasses.FakeTensor)
    assert plan.peak_bytes == plan_without_optimizer.peak_bytes


@pytest.mark.parametrize("kwargs,error,match", [
    ({"optimizer": "sgd"}, ValueError, "optimizer must be None, 'clipshard'"),
    ({"autocast": torch.float64}, ValueError, "autocast must be None, torch.bfloat16"),
    ({"dim": 32}, ValueError, "leave dim, dtype, hard_negatives and teacher_dim out"),
    ({"inputs": 5}, TypeError, "inputs must be a callable"),
    ({"model": 5}, TypeError, "model must be a callable that builds the model"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        plan_memory(_cache(_model("meta")), world_size=1, batch_size=BATCH, device="cpu", **kwargs)


def test_a_function_model_and_a_model_without_open_clip_inputs_are_refused_clearly():
    with pytest.raises(TypeError, match="planned for an nn.Module model"):
        plan_memory(clipshard.GradCache(lambda i, t: None, clipshard.ClipLoss(), 4), world_size=1, batch_size=8)
    with torch.device("meta"):
        plain = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="pass inputs=, a callable batch_size -> \\(images, texts\\)"):
        plan_memory(clipshard.GradCache(plain, clipshard.ClipLoss(), 4), world_size=1, batch_size=8)
    with pytest.raises(ValueError, match="optimizer, autocast, inputs, model and batch_on_device plan a GradCache"):
        plan_memory(clipshard.ClipLoss(), world_size=1, batch_size=8, dim=4, optimizer="torch")


def test_grad_cache_still_checks_its_inputs_while_a_plan_traces_over_ranks():
    """Under a plan GradCache's checks raise on this rank alone (every rank holds the same inputs)."""
    def mismatched(batch_size):
        return torch.empty(batch_size, 3, 32, 32), torch.empty(batch_size - 1, 16, dtype=torch.int64)

    with pytest.raises(ValueError, match="images and texts must have the same batch size"):
        plan_memory(_cache(_model("meta")), world_size=2, batch_size=BATCH, device="cpu", inputs=mismatched)


def test_sample_ids_are_on_the_device_with_the_batch_on_the_host():
    plan = plan_memory(_cache(_model("meta")), world_size=1, batch_size=BATCH, device="cpu", sample_ids=True,
                       batch_on_device=False)
    assert plan.counted_before[1] == (BATCH * 8, f"the local batch's inputs: ({BATCH},) int64")


_PLAN_THEN_FORK = """
import torch, clipshard
from clipshard.planning import plan_memory
from tests.dist_utils import run_group

def backward_on_rank(rank, world_size):
    x = torch.ones(3, requires_grad=True)
    (2 * x).sum().backward()
    return x.grad.tolist()

plan_memory(clipshard.ClipLoss(), world_size=1, batch_size=4, dim=8, device="cpu")  # the process's first backward
assert run_group(backward_on_rank, 2) == [[2.0] * 3] * 2
"""


def test_a_process_whose_first_backward_was_a_plan_can_fork_ranks_that_run_backward():
    """Fake tensors' first backward would start autograd's device threads, after which a forked
    child cannot run backward; fake_world starts the engine outside the fake mode first."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _PLAN_THEN_FORK], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_plan_for_cuda_runs_layer_norm_in_fp32_under_autocast_as_cuda_does():
    """CPU autocast leaves layer_norm in its input's dtype, CUDA's runs it in fp32: a plan for CUDA
    follows CUDA, and CPU autocast is as it was afterwards."""
    def layer_norms(device):
        plan = plan_memory(_cache(_model("meta")), world_size=1, batch_size=BATCH, device=device,
                           autocast=torch.bfloat16)
        return {what.rsplit(" ", 1)[1] for _, what in plan.peak_allocations
                if "native_layer_norm -> (4, 17, " in what}  # the vision tower's (its input is bf16)

    assert layer_norms("cuda") == {"float32"}
    assert layer_norms("cpu") == {"bfloat16"}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(2, 8, dtype=torch.bfloat16)
        assert torch.nn.functional.layer_norm(x, (8,), torch.ones(8), torch.zeros(8)).dtype == torch.bfloat16
