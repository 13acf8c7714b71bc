"""clipshard.GradCache: a training step whose memory does not grow with the contrastive batch.

    cache = clipshard.GradCache(model, loss_fn, micro_batch_size=64)
    loss = cache(images, texts)     # the loss of the whole batch, evaluated once
    loss.backward()                 # gradients of the plain full-batch step

The loss of a batch of M pairs couples every sample with every other, so its gradient with respect
to the model needs all M feature pairs at once; but it depends on the model only through those
features. So (the gradient cache of Gao et al., 2021):
  1. forward: the model runs over micro-batches of m rows under no_grad (no activations kept),
     the features are concatenated, the loss is evaluated once on the whole batch and its
     gradients G with respect to the features (M x D each, plus logit_scale / logit_bias) kept;
  2. backward (when loss.backward() reaches the returned loss, scaled by its incoming gradient g):
     each micro-batch runs again with grad, and backward(features_i, g * G_i) adds its part of the
     parameters' gradient. By the chain rule the sum is the full-batch gradient. Outputs without a
     batch dimension (logit_scale, logit_bias) get their gradient once, in the last re-run.
Tensors that loss_fn itself differentiates through (its own parameters: a learned temperature, a
projection head; found in the loss's autograd graph) get g times the gradient the first pass took
with respect to them, as in the plain step.
Activations live for one micro-batch at a time; the cost is one extra forward of the model.

sample_ids (the pairs' ids) go to loss_fn as they are, not split: the model never sees them. Hard
negatives are texts: their features come from the text tower, which model(images, texts) cannot
run alone, so they need encode_text (a text-only call): their micro-batches run through it in both
passes like the model's, and loss_fn gets their features as hard_negatives=.

Each re-run draws the random numbers of its first pass (dropout masks and the like): the CPU
generator and every CUDA device's are saved before each micro-batch and restored for its re-run,
and the generators are put back afterwards. Autocast regions active at the call are re-entered.
Over ranks the re-runs accumulate locally and only the last one synchronises gradients (DDP's
no_sync, FSDP2's set_requires_gradient_sync), so gradients are reduced once per step.
docs/grad_cache.md.
"""
import contextlib

import torch

from clipshard import _micro_batches as mb
from clipshard.ops.inputs import check_bool

FN = mb.FN


class GradCache:
    """A training step over any `model(images, texts)` returning open_clip's outputs (a dict with
    image_features, text_features, logit_scale[, logit_bias], or the tuple in that order) and any
    `loss_fn` with open_clip's loss call signature (clipshard's ClipLoss / SigLipLoss in every mode,
    open_clip's own). loss_fn may return a scalar or a dict of scalars (output_dict=True), summed.

    micro_batch_size: rows per model call (an int >= 1); the loss always sees the whole batch.
    allow_batch_norm: BatchNorm in training mode normalises each micro-batch with its own
        statistics (and updates its running statistics twice), so the step is not the full-batch
        step; GradCache refuses such a model unless this is True.
    parameters: None (default) accumulates the re-runs' gradients into .grad with nested backward
        passes (DDP / FSDP2 models synchronise on the last one). Given the model's parameters (an
        iterable of tensors), the returned loss instead carries their summed gradient through its
        own graph: for a GradCache called inside a model's forward that DDP wraps
        (apply_to_transformers), where DDP expects each parameter's gradient once per forward.
    encode_text: the text tower alone (a callable: a micro-batch of hard_negative_texts -> its H x D
        features, normalised like text_features, e.g. `lambda t: model.encode_text(t, normalize=True)`
        for open_clip); needed only for hard_negative_texts.
    loss_fn's own trainable tensors (a module's parameters, or tensors a function closes over) get
    their plain-step gradient too; with parameters=None, a DDP / FSDP2 model's own parameters must
    reach the loss through the model's outputs, not through loss_fn (refused: docs/grad_cache.md).
    """

    def __init__(self, model, loss_fn, micro_batch_size, *, allow_batch_norm=False, parameters=None,
                 encode_text=None):
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
            raise TypeError(f"{FN}: micro_batch_size must be an int, got {micro_batch_size!r} "
                            f"({type(micro_batch_size).__name__})")
        if micro_batch_size < 1:
            raise ValueError(f"{FN}: micro_batch_size must be >= 1, got {micro_batch_size}")
        for name, value in (("model", model), ("loss_fn", loss_fn)):
            if not callable(value):
                raise TypeError(f"{FN}: {name} must be callable, got {type(value).__name__}")
        if encode_text is not None and not callable(encode_text):
            raise TypeError(f"{FN}: encode_text must be callable or None, got {type(encode_text).__name__}")
        check_bool(FN, "allow_batch_norm", allow_batch_norm)
        self.model, self.loss_fn, self.micro_batch_size = model, loss_fn, micro_batch_size
        self.encode_text = encode_text
        self.allow_batch_norm = allow_batch_norm
        self.parameters = None if parameters is None else [p for p in _tensor_list(parameters) if p.requires_grad]
        if self.parameters is not None:
            _check_covers_the_model(model, self.parameters)

    def __call__(self, images, texts, *, sample_ids=None, hard_negative_texts=None):
        """The loss of the whole batch (a 0-dim tensor). Its backward re-runs the model per
        micro-batch; without grad mode (evaluation) it is just the loss.

        sample_ids: None or the M pairs' int64 ids, handed to loss_fn as sample_ids= (whole).
        hard_negative_texts: None or H texts (a tensor or dict / tuple of tensors, like `texts`; H may
        be 0), run through encode_text in micro-batches; loss_fn gets their H x D features as
        hard_negatives=."""
        group = mb.check_group(self.model, self.loss_fn)
        mb.raise_on_every_rank(group, self._input_error(images, texts, sample_ids, hard_negative_texts))
        pieces = list(zip(mb.split(images, self.micro_batch_size), mb.split(texts, self.micro_batch_size)))
        negatives = [] if hard_negative_texts is None else mb.split(hard_negative_texts, self.micro_batch_size)
        keywords = {} if sample_ids is None else {"sample_ids": sample_ids}
        if not torch.is_grad_enabled():
            outputs = [self.model(*piece) for piece in pieces]
            features = [self.encode_text(piece) for piece in negatives]
            outputs, features = _read_first_pass(group, pieces, outputs, negatives, features)
            if negatives:
                keywords["hard_negatives"] = torch.cat(features)
            return _total(outputs[0].call(self.loss_fn, _concatenated(outputs), keywords))
        step = _Step(self, group, pieces, negatives, keywords)
        anchor = torch.zeros((), device=step.loss.device, requires_grad=True)
        return _ReplayInBackward.apply(step, step.loss, anchor, *step.inputs)

    def _negative_features(self, piece):
        return mb.negative_features(self.encode_text(piece), mb.negative_count(piece))

    def _input_error(self, images, texts, sample_ids, hard_negative_texts):
        """The error this call's inputs deserve, or None (raised on every rank by the caller)."""
        norms = [] if self.allow_batch_norm else mb.training_batch_norms(self.model)
        if norms:
            return ValueError(f"{FN}: model has BatchNorm in training mode ({', '.join(norms)}), whose "
                              "statistics differ per micro-batch; put it in eval mode or pass "
                              "allow_batch_norm=True to accept per-micro-batch statistics")
        if hard_negative_texts is not None and self.encode_text is None:
            return ValueError(f"{FN}: hard_negative_texts needs GradCache(..., encode_text=...): their features "
                              "come from the text tower, and model(images, texts) cannot run it alone; pass the "
                              "text tower as a callable (a micro-batch of texts -> its H x D features)")
        try:
            rows = mb.batch_size(images, texts)
            if sample_ids is not None:
                mb.check_sample_ids(sample_ids, rows)
            if hard_negative_texts is not None:
                mb.negative_count(hard_negative_texts)
        except (TypeError, ValueError) as error:
            return error
        return None


def _tensor_list(parameters):
    """`parameters` (GradCache's argument: an iterable of tensors, e.g. model.parameters()) as a list."""
    if torch.is_tensor(parameters) or not hasattr(parameters, "__iter__"):
        raise TypeError(f"{FN}: parameters must be an iterable of tensors (such as model.parameters()) or None, "
                        f"got {'a tensor' if torch.is_tensor(parameters) else type(parameters).__name__}")
    tensors = {}
    for index, p in enumerate(parameters):
        if not torch.is_tensor(p):
            raise TypeError(f"{FN}: parameters must be an iterable of tensors, got {type(p).__name__} at "
                            f"position {index}")
        tensors.setdefault(id(p), p)  # a tensor listed twice would get its gradient twice
    return list(tensors.values())


def _check_covers_the_model(model, parameters):
    """In `parameters` mode only the listed tensors get the re-runs' gradients: a trainable parameter
    of an nn.Module model left out would silently get none, where the plain step gives it one."""
    if not isinstance(model, torch.nn.Module):
        return
    listed = {id(p) for p in parameters}
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in listed]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{FN}: parameters must hold every trainable parameter of the model (model.parameters()); "
                         f"it misses {shown}, which would get no gradient (set requires_grad=False to freeze them)")


def _graph_leaves(tensor, known):
    """The leaf tensors requiring grad that `tensor`'s autograd graph reaches, other than `known`:
    what a loss_fn differentiated through besides the features it was given (its own parameters)."""
    known = {id(t) for t in known}
    found, seen, stack = {}, set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if leaf is not None and id(leaf) not in known:
            found[id(leaf)] = leaf
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


def _rows(piece):
    return mb.batch_size(*piece)


def _read_first_pass(group, pieces, outputs, negatives, features):
    """The model's outputs per micro-batch as mb.Outputs and encode_text's features per micro-batch
    of hard negatives, checked; a problem raises on every rank of `group` before loss_fn runs (the
    model has run on every micro-batch by then, as on the other ranks: FSDP1's forward gathers)."""
    try:
        outputs = [mb.Outputs(output, _rows(piece)) for output, piece in zip(outputs, pieces)]
        features = [mb.negative_features(f, mb.negative_count(piece)) for f, piece in zip(features, negatives)]
        error = None
    except ValueError as problem:
        error = problem
    mb.raise_on_every_rank(group, error)
    return outputs, features


def _total(loss):
    """A loss_fn result as one scalar: a dict of terms (open_clip's output_dict) is summed."""
    if isinstance(loss, dict):
        loss = sum(loss.values())
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise ValueError(f"{FN}: loss_fn must return a scalar tensor (or a dict of them), got "
                         f"{type(loss).__name__ if not torch.is_tensor(loss) else tuple(loss.shape)}")
    return loss.reshape(())


def _concatenated(outputs):
    """The whole batch's loss inputs: batched outputs concatenated, the others from the first
    micro-batch (they do not depend on the samples)."""
    values = dict(outputs[0].values)
    for key in outputs[0].batched:
        values[key] = torch.cat([o.values[key] for o in outputs])
    return values


class _Step:
    """One call's first pass (the loss and its gradients with respect to the model's outputs) and
    what its re-runs need."""

    def __init__(self, cache, group, pieces, negatives, keywords):
        self.cache, self.pieces, self.negatives = cache, pieces, negatives
        self.autocast = mb.autocast_state()
        self.random_states, outputs = [], []
        for piece in pieces:
            self.random_states.append(mb.RandomState())
            with torch.no_grad():
                outputs.append(cache.model(*piece))
        self.negative_states, negative_features = [], []
        for piece in negatives:
            self.negative_states.append(mb.RandomState())
            with torch.no_grad():
                negative_features.append(cache.encode_text(piece))
        outputs, negative_features = _read_first_pass(group, pieces, outputs, negatives, negative_features)
        self.layout = outputs[0]
        values = _concatenated(outputs)
        leaves = {k: values[k].detach().requires_grad_(values[k].is_floating_point())
                  for k in self.layout.batched + self.layout.unbatched}
        values.update(leaves)
        negative_leaf = None
        if negatives:
            features = torch.cat(negative_features)
            negative_leaf = features.detach().requires_grad_(features.is_floating_point())
            keywords = {**keywords, "hard_negatives": negative_leaf}
        with torch.enable_grad():
            loss = _total(self.layout.call(cache.loss_fn, values, keywords))
            if not loss.requires_grad:  # the plain step's backward would raise
                raise ValueError(f"{FN}: loss_fn's result does not require grad: it depends neither on the "
                                 "features it was given nor on any parameter (computed under no_grad, or detached?)")
            wanted = {k: v for k, v in leaves.items() if v.requires_grad}
            negative = [negative_leaf] if negative_leaf is not None and negative_leaf.requires_grad else []
            own = _graph_leaves(loss, list(wanted.values()) + negative)
            self._refuse_synchronised_parameters(own)
            grads = torch.autograd.grad(loss, list(wanted.values()) + negative + own, allow_unused=True)
        self.loss = loss.detach()
        self.grads = {k: g for k, g in zip(wanted, grads) if g is not None}
        self.negative_grad = grads[len(wanted)] if negative else None
        grads = grads[:len(wanted)] + grads[len(wanted) + len(negative):]
        # what the returned loss's autograd node takes: the model's parameters in `parameters` mode,
        # then loss_fn's own tensors, each with the gradient the loss gave it (None: from the re-runs only)
        self.inputs = list(cache.parameters or ())
        self.own_grads = [None] * len(self.inputs)
        positions = {id(p): i for i, p in enumerate(self.inputs)}
        for leaf, grad in zip(own, grads[len(wanted):]):
            if id(leaf) not in positions:
                positions[id(leaf)] = len(self.inputs)
                self.inputs.append(leaf)
                self.own_grads.append(None)
            self.own_grads[positions[id(leaf)]] = grad
        self.rows = [_rows(piece) for piece in pieces]

    def _refuse_synchronised_parameters(self, own):
        """With nested backward passes, a DDP / FSDP2 model synchronises its gradients in the last
        re-run; a gradient loss_fn adds to one of its parameters afterwards would arrive after the
        reduction (or be refused by DDP)."""
        cache = self.cache
        if cache.parameters is not None or mb.synchronising_module(cache.model) is None:
            return
        model_parameters = {id(p): name for name, p in cache.model.named_parameters()}
        names = [model_parameters[id(t)] for t in own if id(t) in model_parameters]
        if names:
            raise ValueError(f"{FN}: loss_fn differentiates through the model's own parameters ({', '.join(names)}) "
                             f"of a {mb.synchronising_module(cache.model)} model, which synchronises its gradients "
                             "in the last re-run, before loss_fn's gradient would arrive; return them among the "
                             "model's outputs (as logit_scale) instead")

    def _backward(self, pairs, grad_output, summed):
        """Back-propagates (output, cached gradient) pairs times grad_output: into .grad, or (in
        `parameters` mode) added to `summed`, the parameters' gradients so far, which it returns."""
        cache = self.cache
        tensors = [t for t, _ in pairs]
        grads = [(g * grad_output).to(t.dtype) for t, g in pairs]
        if cache.parameters is None:
            if tensors:
                torch.autograd.backward(tensors, grads)
            return summed
        found = torch.autograd.grad(tensors, cache.parameters, grads, allow_unused=True) \
            if tensors and cache.parameters else [None] * len(cache.parameters)
        return list(found) if summed is None else [_add(a, b) for a, b in zip(summed, found)]

    def _replay_negatives(self, grad_output, summed):
        """The hard negatives' re-runs through encode_text (before the model's, whose last one
        synchronises gradients over ranks)."""
        cache, start = self.cache, 0
        for index, piece in enumerate(self.negatives):
            rows = slice(start, start + mb.negative_count(piece))
            start = rows.stop
            if self.negative_grad is None or rows.stop == rows.start:
                continue
            self.negative_states[index].restore()
            with (mb.without_gradient_sync(cache.model) if cache.parameters is None else contextlib.nullcontext()), \
                    torch.enable_grad(), mb.autocast(self.autocast):
                features = cache._negative_features(piece)
                if features.requires_grad:
                    summed = self._backward([(features, self.negative_grad[rows])], grad_output, summed)
        return summed

    def replay(self, grad_output):
        """Re-runs every micro-batch with grad and back-propagates its share of the cached
        gradients times grad_output. Returns the parameters' gradients in `parameters` mode."""
        cache, last = self.cache, len(self.pieces) - 1
        generators = mb.RandomState()
        summed = None
        start = 0
        try:
            summed = self._replay_negatives(grad_output, summed)
            for index, piece in enumerate(self.pieces):
                self.random_states[index].restore()
                rows = slice(start, start + self.rows[index])
                start = rows.stop
                sync = index == last or cache.parameters is not None
                with (mb.without_gradient_sync(cache.model) if not sync else contextlib.nullcontext()), \
                        torch.enable_grad(), mb.autocast(self.autocast):
                    output = mb.Outputs(cache.model(*piece), self.rows[index])
                keys = [k for k in output.batched if k in self.grads]
                if index == last:
                    keys += [k for k in output.unbatched if k in self.grads]
                pairs = [(output.values[k], self.grads[k][rows] if k in output.batched else self.grads[k])
                         for k in keys if output.values[k].requires_grad]
                summed = self._backward(pairs, grad_output, summed)
        finally:
            generators.restore()
        summed = summed or [None] * len(cache.parameters or ())
        own = [None if g is None else (g * grad_output).to(g.dtype) for g in self.own_grads]
        return [_add(a, b) for a, b in zip(summed + [None] * (len(own) - len(summed)), own)]


def _add(a, b):
    return b if a is None else a if b is None else a + b


class _ReplayInBackward(torch.autograd.Function):
    """The loss value forward; its backward runs the step's re-runs (nested backward passes, or the
    parameters' gradients returned here in `parameters` mode) and returns loss_fn's own tensors'
    gradients."""

    @staticmethod
    def forward(ctx, step, loss, anchor, *inputs):
        ctx.step = step
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.step is None:
            raise RuntimeError(f"{FN}: backward ran twice through the same loss; call the GradCache again")
        step, ctx.step = ctx.step, None  # frees the cached gradients and inputs once done
        return (None, None, None, *step.replay(grad_output))
