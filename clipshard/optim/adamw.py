"""Half-precision AdamW with stochastic rounding, in one fused pass per step.

`AdamW` is torch.optim.AdamW's update (decoupled weight decay, bias correction) for parameters
stored in fp32, fp16 or bf16 without an fp32 master copy, with moment estimates stored in fp32,
bf16 or fp16. Each step reads parameter, gradient and moments once, computes the update in fp32
registers and writes the 16-bit results back with stochastic rounding (or round-to-nearest when
`stochastic_rounding=False`). fp16 second moments are stored as v**(1/4), under the state key
"exp_avg_sq_fourth_root", so that gradients from 1e-8 to 1e4 neither underflow nor overflow.
See docs/optimizer.md.
"""
import math
import numbers

import torch
from torch.optim import Optimizer

from clipshard.ops.adamw_step import adamw_step_
from clipshard.ops.inputs import check_bool, check_generator
from clipshard.ops.seeds import draw_seed_offset
from clipshard.optim.dtensor import check_dtensor_param, index_base, is_dtensor, local, state_in_param_layout, \
    zeros_state_like
from clipshard.rounding import stochastic_round

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_PARAM_DTYPES = (torch.float32,) + _HALF_DTYPES
_NAME = "clipshard.optim.AdamW"


def second_moment_key(state_dtype: torch.dtype) -> str:
    """The state key of the second moment: fp16 stores v**(1/4), the other dtypes store v."""
    return "exp_avg_sq_fourth_root" if state_dtype == torch.float16 else "exp_avg_sq"


def _check_number(name, value, low, high=float("inf"), high_open=True):
    """A real number (not a bool, not a tensor) in [low, high) (or [low, high]), finite."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{_NAME}: {name} must be a Python number, got a Tensor (tensor {name} is not supported)")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_NAME}: {name} must be a number, got {value!r} ({type(value).__name__})")
    in_range = low <= value < high if high_open else low <= value <= high
    if not (in_range and math.isfinite(value)):
        interval = f"[{low}, {high})" if high < float("inf") else f"finite and >= {low}"
        raise ValueError(f"{_NAME}: {name} must be {interval}, got {value}")


def _check_group(group):
    """The hyper-parameters and options of one param group (also re-checked at every step: schedulers
    and users may change them)."""
    for flag in ("amsgrad", "maximize", "stochastic_rounding"):
        check_bool(_NAME, flag, group[flag])
    if group["amsgrad"]:
        raise NotImplementedError(f"{_NAME}: amsgrad=True is not supported")
    _check_number("lr", group["lr"], 0.0)
    _check_number("eps", group["eps"], 0.0)
    _check_number("weight_decay", group["weight_decay"], 0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{_NAME}: betas must be a pair of numbers (beta1, beta2), got {betas!r}")
    for name, beta in zip(("betas[0]", "betas[1]"), betas):
        _check_number(name, beta, 0.0, 1.0)
    state_dtype = group["state_dtype"]
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
            With sharded (DTensor) parameters, give every rank a generator in the same state (for
            example torch.Generator().manual_seed(s) with the same s) so that the weights do not
            depend on the world size.
    DTensor parameters (FSDP2's fully_shard): Replicate() and Shard(0) placements on any mesh; each
    rank updates its local shard, the state tensors are DTensors placed like the parameter, and
    every element's random bits come from its index in the full parameter (docs/optimizer.md).
    Not supported (clear errors): amsgrad=True, sparse gradients, tensor lr, parameters that are
    not fp32/fp16/bf16 (fp64, complex, integer) or not contiguous, other DTensor placements.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 amsgrad=False, maximize=False, state_dtype=None, stochastic_rounding=True, generator=None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, state_dtype=state_dtype, stochastic_rounding=stochastic_rounding)
        _check_group(defaults)
        defaults["betas"] = tuple(betas)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"{_NAME}: generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.generator = generator
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_group(group)
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
        state["exp_avg"] = zeros_state_like(p, state_dtype)
        state[second_moment_key(state_dtype)] = zeros_state_like(p, state_dtype)

    def _updates(self):
        """Checks every group and every parameter with a gradient before anything is updated, and
        returns, per group, (tensor number, parameter) for the parameters to update. A parameter's
        tensor number, which picks its random streams, is its position in all groups' parameter
        lists, whether or not it has a gradient: the same on every rank and for any sharding."""
        updates, number = [], 0
        for group in self.param_groups:
            _check_group(group)
            todo = []
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    name = _param_name(group, i, number, p)
                    grad = p.grad
                    if grad.is_sparse:
                        raise RuntimeError(f"{_NAME}: sparse gradients are not supported ({name})")
                    if grad.dtype != p.dtype or grad.shape != p.shape:
                        raise ValueError(f"{_NAME}: the gradient of {name} must have the parameter's dtype and "
                                         f"shape, got {grad.dtype} {tuple(grad.shape)}")
                    check_dtensor_param(f"{_NAME}: {name}", p, grad)
                    todo.append((number, p))
                number += 1
            updates.append((group, todo))
        return updates

    # Under torch.compile the step runs eagerly (one graph break): it is one fused custom op per
    # bucket already, and tracing its per-parameter Python bookkeeping would only add guards and
    # recompiles (one per parameter object).
    @torch._dynamo.disable
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter with a gradient, as torch.optim.AdamW computes it
        (decoupled weight decay, bias correction), in one fused pass per (device, dtype) bucket.

        The update is computed in fp32; 16-bit parameters and moments are written back with
        stochastic rounding (round-to-nearest with stochastic_rounding=False), with random bits
        drawn from `generator` (default: torch's default generator). Parameters without .grad
        are skipped; their state is created on their first step. DTensor parameters: each rank
        updates its local shard. Everything is checked before any parameter is updated. closure:
        as in torch, re-evaluates the model and returns the loss, which step then returns (else None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, todo in self._updates():
            buckets = {}  # (device, param dtype, state dtype) -> lists for one fused call
            for number, p in todo:
                state = self.state[p]
                if len(state) == 0:
                    self._init_state(p, state, group)
                exp_avg = state["exp_avg"]
                exp_avg_sq = state[second_moment_key(exp_avg.dtype)]
                state["step"] = state["step"] + 1  # a new tensor: a loaded state dict may share the old one
                lists = buckets.setdefault((p.device, p.dtype, exp_avg.dtype), tuple([] for _ in range(8)))
                values = (local(p), local(p.grad).contiguous(), local(exp_avg), local(exp_avg_sq),
                          int(state["step"].item()), number, index_base(p),
                          [t for t in (p, exp_avg, exp_avg_sq) if is_dtensor(t)])
                for target, value in zip(lists, values):
                    target.append(value)
            beta1, beta2 = group["betas"]
            for (device, param_dtype, state_dtype), (ps, gs, ms, vs, steps, numbers, bases, wrappers) in \
                    buckets.items():
                random = group["stochastic_rounding"] and (
                    param_dtype in _HALF_DTYPES or state_dtype in _HALF_DTYPES)
                if random:
                    check_generator(_NAME, self.generator, device)
                seed, offset = draw_seed_offset(device, self.generator) if random else (0, 0)
                adamw_step_(
                    ps, gs, ms, vs, steps, float(group["lr"]), float(beta1), float(beta2),
                    float(group["eps"]), float(group["weight_decay"]), group["maximize"],
                    group["stochastic_rounding"], seed, offset, numbers, bases)
                # The kernel writes through pointers: tell autograd, as torch's optimizers' in-place
                # ops do, so that a graph which saved a parameter raises instead of using new values
                # (DTensors and their local shards each have a version counter).
                torch.autograd.graph.increment_version(ps + ms + vs + [t for ts in wrappers for t in ts])
        return loss

    def load_state_dict(self, state_dict):
        """As torch's, except that moment tensors keep their saved dtypes (torch would cast them to
        the parameter's dtype, losing fp32 moments of 16-bit parameters), that every state tensor is
        a copy (torch's loader may share tensors, `step` among them, with the given dict), and that
        each parameter's state is checked before anything is loaded: a torch.optim.AdamW state of an
        fp16 parameter (v itself in fp16) is converted to our v**(1/4) storage; a state that step()
        could not use is refused with a ValueError naming the parameter."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        loaded = {saved_id: _loaded_state(index, p, state_dict["state"][saved_id])
                  for index, (saved_id, p) in enumerate(zip(saved_ids, params)) if saved_id in state_dict["state"]}
        super().load_state_dict(state_dict)
        for saved_id, p in zip(saved_ids, params):
            if saved_id in loaded:
                self.state[p] = loaded[saved_id]


def _param_name(group, index, number, p):
    """How errors name a parameter: its name when the optimizer was given named parameters."""
    names = group.get("param_names")
    shape = f"shape {tuple(p.shape)}"
    return f"parameter {names[index]!r} ({shape})" if names else f"parameter #{number} ({shape})"


def _loaded_state(index, param, saved):
    """A copy of one parameter's saved state, laid out as the parameter (on its device; a DTensor
    placed like a DTensor parameter, see dtensor.state_in_param_layout), in the form step() uses."""
    where = f"{_NAME}.load_state_dict: the state of parameter {index} (shape {tuple(param.shape)})"
    state = dict(saved)
    if not state:
        return state
    missing = [key for key in ("step", "exp_avg") if key not in state]
    if missing:
        raise ValueError(f"{where} lacks {missing} (found {sorted(state)})")
    step = state["step"]
    step = step.full_tensor() if is_dtensor(step) else step
    state["step"] = torch.tensor(float(step), dtype=torch.float32)
    for key, value in state.items():
        if torch.is_tensor(value) and key != "step":
            state[key] = state_in_param_layout(f"{where}: {key}", value, param)
    exp_avg = state["exp_avg"]
    if not torch.is_tensor(exp_avg) or exp_avg.dtype not in _PARAM_DTYPES:
        raise ValueError(f"{where}: exp_avg must be a float32, bfloat16 or float16 tensor, got "
                         f"{getattr(exp_avg, 'dtype', type(exp_avg).__name__)}")
    key = second_moment_key(exp_avg.dtype)
    if key not in state and exp_avg.dtype == torch.float16 and torch.is_tensor(state.get("exp_avg_sq")):
        # torch.optim.AdamW's fp16 state holds v; ours holds v**(1/4) (see the module docstring)
        state[key] = state.pop("exp_avg_sq").double().sqrt().sqrt().to(torch.float16)
    second = state.get(key)
    if not torch.is_tensor(second):
        raise ValueError(f"{where} has no {key!r} tensor, which {exp_avg.dtype} moments need (found {sorted(state)})")
    for name in ("exp_avg", key):
        if state[name].shape != param.shape:
            raise ValueError(f"{where}: {name} has shape {tuple(state[name].shape)}")
    if second.dtype != exp_avg.dtype:
        raise ValueError(f"{where}: exp_avg is {exp_avg.dtype} but {key} is {second.dtype}; both moments "
                         "must share one dtype")
    return state


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
    converted once); other dtypes, and DTensors (call it before FSDP2's fully_shard), are refused
    before anything is converted. Returns `targets`.

    For open_clip's CLIP / CustomTextCLIP, clipshard.text_tower_to_half_precision_ converts exactly
    the text tower and keeps the features it hands to the loss in the rest of the model's dtype."""
    fn = "to_half_precision_"
    if dtype not in _HALF_DTYPES:
        raise ValueError(f"{fn}: dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    named = _named_tensors(fn, targets, buffers)
    for kind, name, t in named:
        if is_dtensor(t):  # the op rounds whole tensors: a shard would draw the bits of other elements
            raise ValueError(f"{fn}: {kind} {name!r} is a DTensor (FSDP2's fully_shard, or another DTensor "
                             "API, has sharded it); convert before sharding: to_half_precision_(model), then "
                             "fully_shard(model) (docs/optimizer.md, FSDP2). Nothing was converted")
        if t.dtype not in (torch.float32, dtype):
            raise TypeError(f"{fn}: {kind} {name!r} is {t.dtype}; only float32 tensors are converted")
    for _, _, t in named:
        if t.dtype == torch.float32:
            t.data = stochastic_round(t.data.contiguous(), dtype, generator=generator)
            # A graph that saved the fp32 tensor must not differentiate with the 16-bit one.
            torch.autograd.graph.increment_version(t)
    return targets
