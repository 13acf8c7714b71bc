"""plan_memory for a GradCache step: one rank's peak over a whole training step (docs/grad_cache.md,
"Planning a step's memory").

A step is what the GPU must hold while training: the model's weights, its gradients, the
optimizer's state, one micro-batch's activations, the cached features and their gradients, and the
loss. The plan runs GradCache's own code (its no-grad feature pass, the loss on the whole local
batch, the re-forward + backward of every micro-batch) and then the optimizer's step, on fake
tensors in a fake world of N ranks (clipshard/planning/fake_world.py), under an AllocationTracker.

- The model: a copy of the GradCache's model with its parameters and buffers as fake tensors (the
  caller's module is left as it is, so it may live on the meta device: `with torch.device("meta"):`
  or open_clip.create_model(..., device="meta")), or the module a `model` factory builds inside the
  fake mode. Its weights are live before the step: `counted_before`, and included in peak_bytes.
- The inputs: for open_clip models, images (M, 3, H, W) float32 and token ids (M, context_length)
  int64 (from model.visual.image_size and model.context_length); any other model needs an `inputs`
  factory. With batch_on_device=True the whole local batch is on the device before the step, as
  GradCache's arguments (counted before, included); with False it stays on the host and each
  micro-batch is copied to the device when the model runs (that copy is counted). Sample ids,
  which go to the loss whole, are on the device either way.
- Two steps are traced, with optimizer.zero_grad() (gradients set to None) between them: the
  optimizer creates its state lazily in the first step, and from the second step on that state is
  live for the whole step, so the peak of the two is the peak of any step of a training run. The
  tracker counts from the start of the first step, so a plan is checked against a real run of two
  steps measured from a start where only the weights and inputs exist.
- Representative micro-batches: every micro-batch of a step has the same shapes (the last may be
  shorter), so the same allocations. Running the model for real on each of thousands of
  micro-batches would take an hour on fake tensors; the plan runs it on the first two and the last
  micro-batch of each pass (the first re-run creates the gradients, the second is a re-run with
  gradients already live, the last carries logit_scale's gradient and ends the feature pass with
  every feature live) and, for the others, hands GradCache stand-ins: fresh tensors with the shapes,
  strides and dtypes of the real outputs (without grad, so their re-run adds nothing). What they
  leave live is what the real outputs leave; the peak inside a micro-batch is seen on the real ones.
- Mixed precision: autocast=torch.bfloat16 (or float16) runs the steps under autocast, as a
  mixed-precision loop does (GradCache re-enters it in its re-runs); the optimizer steps outside it.
  The fake tensors are CPU tensors (see clipshard/ops/planned_device.py), so it is CPU autocast's
  list of which ops run in 16 bits that applies; for a plan for CUDA, layer_norm follows CUDA's
  rule (fp32) instead (clipshard/planning/cuda_autocast_rules.py). Other ops that CUDA's autocast
  puts in fp32 (softmax, norms, exp, ...) are not emulated.
Not planned: hard_negative_texts (GradCache's encode_text), DDP / FSDP wrappers (the plan runs the
plain module; DDP's gradient buckets add about one gradient's size), the allocator's fragmentation.
"""
import contextlib
import copy
import time

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from clipshard.losses import ClipLoss, DistillClipLoss, SigLipLoss
from clipshard.planning.allocation_tracker import AllocationTracker
from clipshard.planning.cuda_autocast_rules import cuda_autocast_rules
from clipshard.planning.fake_world import fake_world
from clipshard.planning.loss_plan import CUDA_ROUNDING, checked_device_type, positive_int
from clipshard.planning.memory_plan import MemoryPlan

FN = "plan_memory"
STEPS = 2  # the first step creates the optimizer's state, the second holds it throughout
GRADIENTS, STATE = "the parameters' gradients (.grad)", "the optimizer's state"
_HALF = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def _optimizer_factory(optimizer):
    """params -> optimizer (or None) from plan_memory's `optimizer` argument."""
    if optimizer is None:
        return None
    if optimizer == "clipshard":
        from clipshard.optim import AdamW
        return AdamW
    if optimizer == "torch":
        return torch.optim.AdamW
    if callable(optimizer):
        return optimizer
    raise ValueError(f"{FN}: optimizer must be None, 'clipshard' (clipshard.optim.AdamW), 'torch' "
                     f"(torch.optim.AdamW) or a callable that builds one from the parameters, got {optimizer!r}")


def _autocast_dtype(autocast):
    if autocast is None:
        return None
    dtype = _HALF.get(autocast, autocast) if isinstance(autocast, str) else autocast
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{FN}: autocast must be None, torch.bfloat16 or torch.float16 (or 'bf16', 'fp16'), "
                         f"got {autocast!r}")
    return dtype


def _meta_copy(model):
    """A copy of the module `model` whose parameters and buffers are meta tensors: nothing
    allocated, the caller's module untouched (made outside the fake mode, which refuses meta inputs)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{FN}: a GradCache step is planned for an nn.Module model (its parameters get "
                        f"gradients and optimizer state), got {type(model).__name__}; pass model=, a callable "
                        "that builds the module")
    memo = {}
    for tensor in _tensors_of(model):
        meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = torch.nn.Parameter(meta, tensor.requires_grad) \
            if isinstance(tensor, torch.nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _fake_model(source):
    """The model the plan trains, built inside the fake mode: the module `source` (a meta copy) or
    the module the factory `source` builds, with fake CPU tensors for its parameters and buffers."""
    built = source if isinstance(source, torch.nn.Module) else source()
    if not isinstance(built, torch.nn.Module):
        raise TypeError(f"{FN}: model must build an nn.Module, got {type(built).__name__}")
    if all(isinstance(t, FakeTensor) and t.device.type == "cpu" for t in _tensors_of(built)):
        return built  # a factory built it in the fake mode
    # to_empty would refuse meta tensors inside the fake mode; empty_strided only reads their shape
    return built._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu"))


def _tensors_of(module):
    return list(module.parameters()) + list(module.buffers())


def _open_clip_inputs(model, batch_size):
    """(images, texts) of an open_clip-like model: (M, 3, H, W) float32 and (M, context_length) int64."""
    visual = getattr(model, "visual", None)
    size = getattr(visual, "image_size", None)
    length = getattr(model, "context_length", None)
    if size is None or length is None:
        raise ValueError(f"{FN}: the model ({type(model).__name__}) has no visual.image_size and context_length "
                         "(open_clip's); pass inputs=, a callable batch_size -> (images, texts)")
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    return (torch.empty(batch_size, 3, height, width), torch.empty(batch_size, length, dtype=torch.int64))


class _RepresentativeModel(torch.nn.Module):
    """The model as the plan runs it: for real on the first two and the last micro-batch of each
    pass, and a stand-in (fresh tensors shaped as the first real output, without grad) for the
    others (module docstring). With copy_inputs, each real call first copies its micro-batch, as a
    model that moves host inputs to the device does."""

    def __init__(self, model, micro_batches, copy_inputs):
        super().__init__()
        self.model, self.micro_batches, self.copy_inputs = model, micro_batches, copy_inputs
        self.calls = {False: 0, True: 0}  # per pass: the no-grad feature pass, the re-runs with grad
        self.template = None

    def forward(self, images, texts):
        grad = torch.is_grad_enabled()
        index = self.calls[grad] % self.micro_batches
        self.calls[grad] += 1
        if self.template is not None and index not in (0, 1, self.micro_batches - 1):
            return self._stand_in()
        if self.copy_inputs:
            images, texts = (tree_unflatten([t.clone() for t in tree_flatten(x)[0]], tree_flatten(x)[1])
                             for x in (images, texts))
        output = self.model(images, texts)
        if self.template is None:
            self._record(output)
        return output

    def _record(self, output):
        leaves, spec = tree_flatten(output)
        own = {id(t.untyped_storage()): t for t in _tensors_of(self.model)}
        self.template = (spec, [_fresh_or_own(t, own) if torch.is_tensor(t) else t for t in leaves])

    def _stand_in(self):
        """Fresh tensors laid out as the recorded output (the model's own tensors returned as they are)."""
        spec, leaves = self.template
        storages, made = {}, []
        for leaf in leaves:
            if isinstance(leaf, tuple):  # a fresh output: the same storage size, shape and strides
                key, nbytes, dtype, shape, stride, offset = leaf
                if key not in storages:
                    storages[key] = torch.empty(nbytes, dtype=torch.uint8)
                leaf = storages[key].view(dtype).as_strided(shape, stride, offset)
            made.append(leaf)
        return tree_unflatten(made, spec)


def _fresh_or_own(tensor, own):
    """How a stand-in makes an output tensor: the model's own tensor when the output is one of its
    parameters or buffers, else (storage key, storage bytes, dtype, shape, strides, offset)."""
    storage = tensor.untyped_storage()
    if id(storage) in own:
        return own[id(storage)]
    return id(storage), storage.nbytes(), tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset()


def _planned_loss(loss_fn, world_size):
    """clipshard's losses act as rank 0 of the fake default group (a shallow copy); others run as given."""
    if isinstance(loss_fn, (ClipLoss, SigLipLoss, DistillClipLoss)):
        planned = copy.copy(loss_fn)
        planned.group, planned.rank, planned.world_size = None, 0, world_size
        return planned
    return loss_fn


def _allocations(tracker, tensors, kind):
    """[(Allocation, kind)] of the tensors' storages that the tracker counts as live."""
    found = (tracker.allocation_of(t) for t in tensors)
    return [(allocation, kind) for allocation in found if allocation is not None]


def _storage_bytes(tensors, round_to):
    seen = {}
    for t in tensors:
        seen[id(t.untyped_storage())] = -(-t.untyped_storage().nbytes() // round_to) * round_to
    return sum(seen.values())


def _weights_line(module):
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()})
    return f"weights and buffers: {sum(p.numel() for p in module.parameters())} parameters ({', '.join(dtypes)})"


def _describe(tensors):
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors)


def plan_step(cache, *, world_size, batch_size, device, optimizer, autocast, inputs, model, batch_on_device,
              sample_ids):
    """The MemoryPlan of one rank's GradCache training step (see clipshard.plan_memory)."""
    positive_int(FN, "world_size", world_size)
    positive_int(FN, "batch_size", batch_size)
    device_type = checked_device_type(FN, device)
    make_optimizer = _optimizer_factory(optimizer)
    autocast = _autocast_dtype(autocast)
    if inputs is not None and not callable(inputs):
        raise TypeError(f"{FN}: inputs must be a callable batch_size -> (images, texts), got {type(inputs).__name__}")
    if cache.encode_text is not None:
        raise ValueError(f"{FN}: a GradCache with encode_text (hard negative texts) is not planned yet")
    round_to = CUDA_ROUNDING if device_type == "cuda" else 1
    micro_batches = -(-batch_size // cache.micro_batch_size)
    if model is not None and not callable(model):
        raise TypeError(f"{FN}: model must be a callable that builds the model, got {type(model).__name__}")
    start = time.perf_counter()
    source = model if model is not None else _meta_copy(cache.model)
    with fake_world(world_size, device_type):
        module = _fake_model(source)
        parameters = [p for p in module.parameters() if p.requires_grad]
        built = make_optimizer(parameters) if make_optimizer is not None else None
        images, texts = (inputs or (lambda m: _open_clip_inputs(module, m)))(batch_size)
        batch = tree_flatten((images, texts))[0]
        keywords = {"sample_ids": torch.empty(batch_size, dtype=torch.int64)} if sample_ids else {}
        planned = copy.copy(cache)
        planned.model = _RepresentativeModel(module, micro_batches, copy_inputs=not batch_on_device)
        planned.loss_fn = _planned_loss(cache.loss_fn, world_size)
        if cache.parameters is not None:
            planned.parameters = parameters
        counted_before = [(_storage_bytes(_tensors_of(module), round_to), _weights_line(module))]
        on_device = (batch if batch_on_device else []) + list(keywords.values())
        if on_device:
            counted_before.append((_storage_bytes(on_device, round_to),
                                   f"the local batch's inputs: {_describe(on_device)}"))
        tracker = AllocationTracker(device_type, round_to=round_to)
        kinds = []  # (Allocation, its kind): the gradients and the optimizer's state, kept to name them
        rules = cuda_autocast_rules() if device_type == "cuda" and autocast is not None else contextlib.nullcontext()
        with rules, tracker:
            for _ in range(STEPS):
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    loss = planned(images, texts, **keywords)
                loss.backward()
                del loss
                kinds += _allocations(tracker, [p.grad for p in parameters if p.grad is not None], GRADIENTS)
                if built is not None:
                    built.step()
                    kinds += _allocations(tracker, [t for state in built.state.values() for t in state.values()
                                                    if torch.is_tensor(t)], STATE)
                    built.zero_grad(set_to_none=True)
                else:
                    module.zero_grad(set_to_none=True)
        del images, texts, batch, on_device, keywords, built, module, parameters, planned
    loss_fn = cache.loss_fn
    setting = [("model", type(cache.model).__name__ if model is None else getattr(model, "__name__", "factory")),
               ("loss", type(loss_fn).__name__), ("mode", getattr(loss_fn, "mode", None)),
               ("world_size", world_size), ("batch_size", batch_size), ("micro_batch_size", cache.micro_batch_size),
               ("optimizer", optimizer if optimizer is None or isinstance(optimizer, str) else "custom"),
               ("autocast", None if autocast is None else str(autocast).removeprefix("torch.")),
               ("batch_on_device", batch_on_device), ("sample_ids", bool(sample_ids)), ("device", device_type)]
    kind_of = {id(allocation): kind for allocation, kind in kinds}
    allocations = sorted(((a.nbytes, kind_of.get(id(a), a.what)) for a in tracker.peak_allocations),
                         key=lambda a: -a[0])
    peak = tracker.peak_bytes + sum(nbytes for nbytes, _ in counted_before)
    return MemoryPlan(peak, allocations, setting, time.perf_counter() - start, counted_before)

