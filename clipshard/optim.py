"""Half-precision AdamW with stochastic rounding, in one fused pass per step.

`AdamW` is torch.optim.AdamW's update (decoupled weight decay, bias correction) for parameters
stored in fp32, fp16 or bf16 without an fp32 master copy, with moment estimates stored in fp32,
bf16 or fp16. Each step reads parameter, gradient and moments once, computes the update in fp32
registers and writes the 16-bit results back with stochastic rounding (or round-to-nearest when
`stochastic_rounding=False`). fp16 second moments are stored as v**(1/4), under the state key
"exp_avg_sq_fourth_root", so that gradients from 1e-8 to 1e4 neither underflow nor overflow.
See docs/optimizer.md.
"""
import torch
from torch.optim import Optimizer

from clipshard._random import draw_seed_offset
from clipshard.rounding import stochastic_round

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_PARAM_DTYPES = (torch.float32,) + _HALF_DTYPES
_NAME = "clipshard.optim.AdamW"


@torch.library.register_fake("clipshard::adamw_step_")
def _adamw_step_fake(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                     maximize, stochastic_rounding, seed, offset):
    return None


def second_moment_key(state_dtype: torch.dtype) -> str:
    """The state key of the second moment: fp16 stores v**(1/4), the other dtypes store v."""
    return "exp_avg_sq_fourth_root" if state_dtype == torch.float16 else "exp_avg_sq"


def _check_hyper(lr, betas, eps, weight_decay, state_dtype):
    if isinstance(lr, torch.Tensor):
        raise TypeError(f"{_NAME}: lr must be a Python number, got a Tensor (tensor lr is not supported)")
    if not 0.0 <= lr < float("inf"):
        raise ValueError(f"{_NAME}: lr must be finite and >= 0, got {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"{_NAME}: eps must be >= 0, got {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{_NAME}: betas must be two numbers in [0, 1), got {betas}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{_NAME}: weight_decay must be >= 0, got {weight_decay}")
    if state_dtype is not None and state_dtype not in _PARAM_DTYPES:
        raise ValueError(f"{_NAME}: state_dtype must be None, torch.float32, torch.bfloat16 or "
                         f"torch.float16, got {state_dtype}")


class AdamW(Optimizer):
    """AdamW for fp32 / fp16 / bf16 parameters with fp32 / bf16 / fp16 moments.

    Args: as torch.optim.AdamW, plus
        state_dtype: dtype of exp_avg and the second moment; None (default) means the parameter's
            dtype for 16-bit parameters and fp32 for fp32 parameters.
        stochastic_rounding: round 16-bit results stochastically (default) or to nearest even.
        generator: torch.Generator on the parameters' device for the rounding's random bits
            (default: torch's default generator, so torch.manual_seed makes runs reproducible).
    Not supported (clear errors): amsgrad=True, sparse gradients, tensor lr, parameters that are
    not fp32/fp16/bf16 (fp64, complex, integer) or not contiguous.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 amsgrad=False, maximize=False, state_dtype=None, stochastic_rounding=True, generator=None):
        if amsgrad:
            raise NotImplementedError(f"{_NAME}: amsgrad=True is not supported")
        _check_hyper(lr, betas, eps, weight_decay, state_dtype)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, state_dtype=state_dtype, stochastic_rounding=stochastic_rounding)
        self.generator = generator
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["amsgrad"]:
            raise NotImplementedError(f"{_NAME}: amsgrad=True is not supported")
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["state_dtype"])
        for p in group["params"]:
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"{_NAME}: parameters must be float32, float16 or bfloat16, got {p.dtype} "
                                f"(shape {tuple(p.shape)})")
            if not p.is_contiguous():
                raise ValueError(f"{_NAME}: parameters must be contiguous, got one of shape {tuple(p.shape)} "
                                 f"and strides {p.stride()}")

    def __setstate__(self, state):
        """Also the end of load_state_dict: groups saved by torch.optim.AdamW lack our options."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("state_dtype", None)
            group.setdefault("stochastic_rounding", True)
            group.setdefault("maximize", False)
            group.setdefault("amsgrad", False)

    def _init_state(self, p, state, group):
        state_dtype = group["state_dtype"] or (p.dtype if p.dtype in _HALF_DTYPES else torch.float32)
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.contiguous_format)
        state[second_moment_key(state_dtype)] = torch.zeros_like(
            p, dtype=state_dtype, memory_format=torch.contiguous_format)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter with a gradient, as torch.optim.AdamW computes it
        (decoupled weight decay, bias correction), in one fused pass per (device, dtype) bucket.

        The update is computed in fp32; 16-bit parameters and moments are written back with
        stochastic rounding (round-to-nearest with stochastic_rounding=False), with random bits
        drawn from `generator` (default: torch's default generator). Parameters without .grad
        are skipped; their state is created on their first step. closure: as in torch, re-evaluates
        the model and returns the loss, which step then returns (else None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["state_dtype"])
            if group["amsgrad"]:
                raise NotImplementedError(f"{_NAME}: amsgrad=True is not supported")
            buckets = {}  # (device, param dtype, state dtype) -> lists for one fused call
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError(f"{_NAME}: sparse gradients are not supported")
                state = self.state[p]
                if len(state) == 0:
                    self._init_state(p, state, group)
                exp_avg = state["exp_avg"]
                exp_avg_sq = state[second_moment_key(exp_avg.dtype)]
                state["step"] = state["step"] + 1  # a new tensor: a loaded state dict may share the old one
                lists = buckets.setdefault((p.device, p.dtype, exp_avg.dtype), ([], [], [], [], []))
                for target, value in zip(lists, (p, grad.contiguous(), exp_avg, exp_avg_sq,
                                                 int(state["step"].item()))):
                    target.append(value)
            beta1, beta2 = group["betas"]
            for (device, param_dtype, state_dtype), (ps, gs, ms, vs, steps) in buckets.items():
                random = group["stochastic_rounding"] and (
                    param_dtype in _HALF_DTYPES or state_dtype in _HALF_DTYPES)
                seed, offset = draw_seed_offset(device, self.generator) if random else (0, 0)
                torch.ops.clipshard.adamw_step_(
                    ps, gs, ms, vs, steps, float(group["lr"]), float(beta1), float(beta2),
                    float(group["eps"]), float(group["weight_decay"]), bool(group["maximize"]),
                    bool(group["stochastic_rounding"]), seed, offset)
        return loss

    def load_state_dict(self, state_dict):
        """As torch's, except that moment tensors keep their saved dtypes (torch would cast them to
        the parameter's dtype, losing fp32 moments of 16-bit parameters), and that every state tensor
        is a copy (torch's loader may share tensors, `step` among them, with the given dict)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            for key, value in saved.items():
                if key == "step":
                    self.state[p][key] = torch.tensor(float(value), dtype=torch.float32)
                elif isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True).contiguous()


def _named_tensors(fn, targets, buffers):
    """(kind, name, tensor) for every tensor to convert in a module, a Parameter, or an iterable of them."""
    if isinstance(targets, (torch.nn.Module, torch.Tensor)):
        targets = [targets]
    named = []
    for i, target in enumerate(targets):
        if isinstance(target, torch.nn.Module):
            named += [("parameter", n, t) for n, t in target.named_parameters()]
            if buffers:
                named += [("buffer", n, t) for n, t in target.named_buffers() if t.is_floating_point()]
        elif isinstance(target, torch.nn.Parameter):
            named.append(("parameter", f"#{i} (shape {tuple(target.shape)})", target))
        else:
            raise TypeError(f"{fn}: expected modules or Parameters (or a list of them), got "
                            f"{type(target).__name__} at position {i}")
    return named


@torch.no_grad()
def to_half_precision_(targets, dtype: torch.dtype = torch.bfloat16, *, buffers: bool = False,
                       generator: torch.Generator | None = None):
    """Converts fp32 parameters to `dtype` in place with stochastic rounding (clipshard.stochastic_round),
    so that part of a model, say a text encoder, is kept in 16 bits without an fp32 master copy and
    its rounding errors average out instead of all pointing the same way.

    targets: a Module (all its parameters; with buffers=True its floating-point buffers too), a
    Parameter, or an iterable mixing both, e.g. `[model.transformer, model.positional_embedding]`.
    Parameters stay the same Parameter objects (their .data is replaced): build the optimizer
    afterwards. Tensors already in `dtype` are left as they are (so a Parameter listed twice is
    converted once); other dtypes are refused before anything is converted. Returns `targets`.

    For open_clip's CLIP / CustomTextCLIP, clipshard.text_tower_to_half_precision_ converts exactly
    the text tower and keeps the features it hands to the loss in the rest of the model's dtype."""
    fn = "to_half_precision_"
    if dtype not in _HALF_DTYPES:
        raise ValueError(f"{fn}: dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    named = _named_tensors(fn, targets, buffers)
    for kind, name, t in named:
        if t.dtype not in (torch.float32, dtype):
            raise TypeError(f"{fn}: {kind} {name!r} is {t.dtype}; only float32 tensors are converted")
    for _, _, t in named:
        if t.dtype == torch.float32:
            t.data = stochastic_round(t.data.contiguous(), dtype, generator=generator)
    return targets
