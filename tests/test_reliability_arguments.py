"""Bad arguments of the public API raise a clear error naming the argument and what was expected,
never an error from deep inside torch, and never a silent reinterpretation (bool('no') is True)."""
import io

import pytest
import torch

import clipshard
from clipshard import stochastic_round, stochastic_round_
from clipshard.optim import AdamW


# ---- stochastic_round / stochastic_round_ -----------------------------------------------------

@pytest.mark.parametrize("saturate", ["no", 0, 1, None, torch.tensor(True)])
def test_saturate_must_be_a_bool(saturate):
    x = torch.ones(4)
    with pytest.raises(TypeError, match="stochastic_round: saturate must be True or False"):
        stochastic_round(x, saturate=saturate)
    with pytest.raises(TypeError, match="stochastic_round_: saturate must be True or False"):
        stochastic_round_(torch.empty(4, dtype=torch.float16), x, saturate=saturate)


@pytest.mark.parametrize("generator", [7, "cpu", torch.Generator().get_state()])
def test_generator_must_be_a_torch_generator(generator):
    with pytest.raises(TypeError, match="stochastic_round: generator must be a torch.Generator or None, got"):
        stochastic_round(torch.ones(4), generator=generator)
    with pytest.raises(TypeError, match="stochastic_round_: generator must be a torch.Generator or None"):
        stochastic_round_(torch.empty(4, dtype=torch.float16), torch.ones(4), generator=generator)


def test_generator_on_another_device_is_refused():
    from clipshard.ops.inputs import check_generator
    with pytest.raises(ValueError, match=r"f: generator must be on the tensors' device \(meta\), got a generator on cpu"):
        check_generator("f", torch.Generator(), torch.device("meta"))
    check_generator("f", torch.Generator(), torch.device("cpu"))  # the right device passes


# ---- AdamW --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(lr="0.1"), TypeError, r"lr must be a number, got '0.1' \(str\)"),
    (dict(lr=None), TypeError, "lr must be a number, got None"),
    (dict(lr=True), TypeError, "lr must be a number, got True"),
    (dict(lr=float("inf")), ValueError, "lr must be finite and >= 0"),
    (dict(lr=float("nan")), ValueError, "lr must be finite and >= 0"),
    (dict(betas=0.9), TypeError, r"betas must be a pair of numbers \(beta1, beta2\), got 0.9"),
    (dict(betas=(0.9,)), TypeError, "betas must be a pair of numbers"),
    (dict(betas=("0.9", 0.99)), TypeError, r"betas\[0\] must be a number"),
    (dict(betas=(0.9, float("nan"))), ValueError, r"betas\[1\] must be \[0.0, 1.0\)"),
    (dict(eps="1e-8"), TypeError, "eps must be a number"),
    (dict(weight_decay=float("inf")), ValueError, "weight_decay must be finite"),
    (dict(maximize="no"), TypeError, "maximize must be True or False, got 'no'"),
    (dict(stochastic_rounding=1), TypeError, "stochastic_rounding must be True or False, got 1"),
    (dict(amsgrad="no"), TypeError, "amsgrad must be True or False"),
    (dict(generator=3), TypeError, "generator must be a torch.Generator or None, got int"),
])
def test_adamw_hyperparameters_of_the_wrong_type_or_value(kwargs, error, match):
    with pytest.raises(error, match="clipshard.optim.AdamW: " + match):
        AdamW([torch.zeros(3, requires_grad=True)], **kwargs)


def test_adamw_checks_param_groups_and_values_changed_later():
    p, q = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"betas must be a pair"):
        AdamW([{"params": [p]}, {"params": [q], "betas": 0.5}])
    opt = AdamW([p])
    opt.param_groups[0]["lr"] = "0.1"
    p.grad = torch.ones(3)
    with pytest.raises(TypeError, match="lr must be a number"):
        opt.step()


@pytest.mark.cuda
def test_generators_on_the_wrong_device_are_refused():
    cuda_generator = torch.Generator(device="cuda")
    with pytest.raises(ValueError, match=r"stochastic_round: generator must be on the tensors' device \(cpu\)"):
        stochastic_round(torch.ones(4), generator=cuda_generator)
    with pytest.raises(ValueError, match=r"stochastic_round: generator must be on the tensors' device \(cuda"):
        stochastic_round(torch.ones(4, device="cuda"), generator=torch.Generator())
    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    opt = AdamW([p], generator=cuda_generator)
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"AdamW: generator must be on the tensors' device \(cpu\), got a generator on cuda"):
        opt.step()


def _torch_adamw_state(param_dtype):
    w = (torch.arange(6, dtype=torch.float64) / 4 + 0.5).to(param_dtype).requires_grad_()
    ref = torch.optim.AdamW([w], lr=1e-2, foreach=False)
    for k in range(3):
        w.grad = ((torch.arange(6, dtype=torch.float64) - k) / 8).to(param_dtype)
        ref.step()
    return w, ref.state_dict()


def test_torch_adamw_state_of_fp16_params_loads_and_steps():
    w, state = _torch_adamw_state(torch.float16)
    v = state["state"][0]["exp_avg_sq"].double()
    ours = AdamW([w], lr=1e-2)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    ours.load_state_dict(torch.load(buffer))
    stored = ours.state[w]
    assert "exp_avg_sq" not in stored and stored["exp_avg_sq_fourth_root"].dtype == torch.float16
    # v**(1/4) rounded to fp16, so the decoded v is within a few fp16 ulps of torch's fp16 v
    decoded = stored["exp_avg_sq_fourth_root"].double() ** 4
    assert ((decoded - v).abs() <= 4 * 2.0 ** -10 * v).all()
    w.grad = torch.full((6,), 0.25, dtype=torch.float16)
    ours.step()  # used to raise KeyError: 'exp_avg_sq_fourth_root'
    assert ours.state[w]["step"].item() == 4


@pytest.mark.parametrize("damage, match", [
    (lambda s: s.pop("exp_avg"), r"lacks \['exp_avg'\]"),
    (lambda s: s.pop("step"), r"lacks \['step'\]"),
    (lambda s: s.pop("exp_avg_sq"), r"has no 'exp_avg_sq' tensor"),
    (lambda s: s.update(exp_avg=torch.zeros(5)), r"exp_avg has shape \(5,\)"),
    (lambda s: s.update(exp_avg=torch.zeros(6, dtype=torch.float64)), "exp_avg must be a float32, bfloat16"),
    (lambda s: s.update(exp_avg_sq=torch.zeros(6, dtype=torch.bfloat16)), "exp_avg is torch.float32 but"),
])
def test_unusable_states_are_refused_at_load_naming_the_parameter(damage, match):
    w, state = _torch_adamw_state(torch.float32)
    damage(state["state"][0])
    ours = AdamW([w])
    where = r"clipshard.optim.AdamW.load_state_dict: the state of parameter 0 \(shape \(6,\)\):? "
    with pytest.raises(ValueError, match=where + match):
        ours.load_state_dict(state)
    assert len(ours.state) == 0  # nothing half-loaded


# ---- losses -------------------------------------------------------------------------------------

def _pair():
    return torch.ones(4, 3), torch.ones(4, 3)


@pytest.mark.parametrize("name", ["local_loss", "gather_with_grad"])
def test_loss_flags_must_be_bools(name):
    with pytest.raises(TypeError, match=f"clip_loss: {name} must be True or False, got 'no'"):
        clipshard.clip_loss(*_pair(), 10.0, **{name: "no"})
    with pytest.raises(TypeError, match=f"ClipLoss: {name} must be True or False, got 0"):
        clipshard.ClipLoss(**{name: 0})


def test_clip_loss_module_arguments():
    with pytest.raises(TypeError, match="ClipLoss: cache_labels must be True or False"):
        clipshard.ClipLoss(cache_labels="yes")
    with pytest.raises(TypeError, match=r"ClipLoss: rank must be an int, got '0' \(str\)"):
        clipshard.ClipLoss(rank="0")
    with pytest.raises(ValueError, match="ClipLoss: world_size must be >= 1, got 0"):
        clipshard.ClipLoss(world_size=0)
    with pytest.raises(TypeError, match="ClipLoss: output_dict must be True or False"):
        clipshard.ClipLoss()(*_pair(), 10.0, output_dict="yes")


def test_contrastive_lse_flags_must_be_bools():
    with pytest.raises(TypeError, match="contrastive_lse: want_col_lse must be True or False, got 'no'"):
        clipshard.contrastive_lse(*_pair(), 10.0, want_col_lse="no")


def test_contrastive_lse_has_no_deterministic_flag():
    """Every path is deterministic: the flag that no path used is gone."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'deterministic'"):
        clipshard.contrastive_lse(*_pair(), 10.0, deterministic=True)
