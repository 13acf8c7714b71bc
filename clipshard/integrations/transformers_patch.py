"""`apply_to_transformers()`: the CLIP- and SigLIP-family models of Hugging Face transformers compute
clipshard's global-batch loss when called with return_loss=True.

The patch point is each covered class's `forward` (transformers_models.COVERED): the module-level
loss functions (`image_text_contrastive_loss`) only see the local logits, from which no global loss
can be computed, and SigLIP's loss is written inline. The patched forward runs the model's own
forward with return_loss=False (so the towers, the normalisation, logit_scale.exp() and the logits
stay the model's code) and adds transformers_loss's loss of the embeddings it returns; with
logits=False it computes the same embeddings without the M x M logits. Undo puts each class's own
forward function object back. The patched forward reads the active patch when called and runs the
class's own forward while none is active, with a signature that follows the same state
(transformers_signature): copies of it made while applied (accelerate's mixed-precision wrapper on a
model instance) are undone too.

Which transformers releases: supported_import.TRANSFORMERS (the oldest supported, the newest
tested). A class is patched when transformers_structure.problem() finds nothing missing, whatever
the version; one whose structure is rejected is left alone and listed in the patch. docs/transformers.md.
"""
import dataclasses
import functools
import inspect
import logging

import torch

from clipshard.integrations import transformers_models as models
from clipshard.integrations import transformers_signature as signatures
from clipshard.integrations import transformers_structure as structure
from clipshard.integrations.bound_methods import own_method_bypasses_patch
from clipshard.integrations.patched import unpatched
from clipshard.integrations.supported_import import TRANSFORMERS
from clipshard.integrations.transformers_loss import global_batch_loss, grad_cache_loss, negative_embeddings

_LOG = logging.getLogger("clipshard")
_FN = "clipshard.apply_to_transformers"


def import_transformers(fn=_FN):
    """transformers, checked to be at least the oldest supported release; a clear ImportError otherwise."""
    return TRANSFORMERS.import_checked(fn)


def _with_global_loss(original, entry):
    """The forward that replaces `original` (entry's class's own forward). It reads the active patch
    (its options) when called, and runs `original` while none is: wrappers made while applied keep
    this function after undo() (accelerate's mixed precision wraps the model instance's forward)."""
    signature = inspect.signature(original)

    @functools.wraps(original)  # keeps the name and docstring; __signature__ below is what Trainer reads
    def forward(self, *args, **kwargs):
        patch = _active
        if patch is None:
            return original(self, *args, **kwargs)
        logits, micro_batch_size = patch.logits, patch.micro_batch_size
        # the loss's own keywords; they change only the loss, so calls without return_loss ignore them
        extras = {name: kwargs.pop(name) for name in models.EXTRA_ARGS if name in kwargs}
        # return_dict is a parameter in 4.5x's signatures, a keyword their wrapper takes in later ones
        return_dict = kwargs.get("return_dict")
        arguments = signature.bind(self, *args, **{k: v for k, v in kwargs.items() if k != "return_dict"}).arguments
        if not arguments.get("return_loss"):
            return original(self, *args, **kwargs)
        arguments = _keywords(arguments)
        return_dict = arguments.pop("return_dict", return_dict)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        ids = {k: extras[k] for k in ("sample_ids", "targets") if extras.get(k) is not None}
        negative_texts = {k.removeprefix(models.NEGATIVE_PREFIX): v for k, v in extras.items()
                          if k.startswith(models.NEGATIVE_PREFIX) and v is not None}
        if negative_texts and "input_ids" not in negative_texts:
            raise ValueError(f"{_FN}: hard negative texts need hard_negative_input_ids, got only "
                             f"{', '.join(models.NEGATIVE_PREFIX + k for k in negative_texts)}")
        if micro_batch_size is not None and torch.is_grad_enabled():
            loss = grad_cache_loss(self, entry, arguments, micro_batch_size, negative_texts=negative_texts, **ids)
            output = entry.output_class()(loss=loss)
            return output if return_dict else output.to_tuple()
        fields = None if logits else _embeddings_without_logits(self, entry, arguments)
        if fields is None:
            output = original(self, **arguments, return_loss=False, return_dict=True)
            fields = dict(output.items())
        image, text = fields["image_embeds"], fields["text_embeds"]
        scale, bias = models.logit_scale_and_bias(self, entry, image.device)
        negatives = negative_embeddings(self, entry, arguments, negative_texts) if negative_texts else None
        fields["loss"] = global_batch_loss(entry.family, image, text, scale, bias, hard_negatives=negatives, **ids)
        output = entry.output_class()(**fields)  # the dataclass's field order: loss first
        return output if return_dict else output.to_tuple()

    forward.__signature__ = signatures.WhileApplied(signature, models.EXTRA_ARGS, applied=lambda: _active is not None)
    forward.clipshard_patched = True
    return forward


def _runs_patched_forward(cls):
    """Whether `cls.forward` is a forward this module installed (not a subclass's override)."""
    return getattr(cls.forward, "clipshard_patched", False)


def _embeddings_without_logits(model, entry, arguments):
    """The output fields of logits=False (embeddings and tower outputs, no logits); None, with one
    warning per class, where the class's get_*_features raise (transformers 4.57's
    ChineseCLIPModel.get_text_features reads a pooler its model does not build): the caller then
    takes the embeddings from the forward, logits included."""
    try:
        image, text, vision_output, text_output = models.embeddings(model, entry, arguments)
    except (TypeError, AttributeError) as e:
        if entry.name not in _features_failed:
            _features_failed.add(entry.name)
            _LOG.warning("clipshard: %s.get_image_features / get_text_features raised %r; its loss is computed "
                         "from its forward's embeddings instead, with the M x M logits (logits=False cannot "
                         "skip them for this class in this transformers release)", entry.name, e)
        return None
    return dict(image_embeds=image, text_embeds=text, vision_model_output=vision_output, text_model_output=text_output)


_features_failed = set()  # classes whose get_*_features raised, warned about once


def _keywords(arguments):
    """The forward's bound arguments as keyword arguments (its **kwargs spread out), without self
    and return_loss."""
    flat = {k: v for k, v in arguments.items() if k not in ("self", "return_loss", "kwargs")}
    flat.update(arguments.get("kwargs", {}))
    return flat


@dataclasses.dataclass
class TransformersPatch:
    """What apply_to_transformers changed. replaced: class name -> its family ("clip" / "siglip");
    kept: transformers' other models with a return_loss, left as they are; logits: whether the
    patched forwards still return logits when computing the loss; originals: class -> its own
    forward, for undo(); rejected: covered class name -> why its structure was not patched (left
    alone); absent: covered classes this transformers release does not have; micro_batch_size: the
    GradCache micro-batch of training calls, or None."""
    replaced: dict
    kept: tuple
    logits: bool
    originals: dict
    rejected: dict = dataclasses.field(default_factory=dict)
    absent: tuple = ()
    active: bool = True
    micro_batch_size: int = None

    def covers(self, model):
        """Whether `model` (or its class) computes clipshard's loss while this patch is active: a
        covered class this patch replaced, or a subclass whose `forward` is still the patched one,
        and not a model holding its own forward bound before the patch (bound_methods)."""
        cls = model if isinstance(model, type) else type(models.unwrap(model))
        entry = models.covered_entry(cls)
        covered = self.active and entry is not None and entry.name in self.replaced and _runs_patched_forward(cls)
        return covered and (isinstance(model, type) or not own_method_bypasses_patch(models.unwrap(model), "forward"))

    def report(self, model):
        """One line saying what `model`'s return_loss=True computes."""
        cls = model if isinstance(model, type) else type(models.unwrap(model))
        entry = models.covered_entry(cls)
        if self.covers(model):
            return f"{cls.__name__}: clipshard's global-batch loss ({entry.family} family)"
        if self.covers(cls):  # the object's own forward, bound before the patch (accelerate's prepare)
            line = (f"{cls.__name__}: left alone, its forward was bound before apply_to_transformers() (as "
                    "accelerate's prepare does for mixed precision); it computes its own loss")
            _LOG.warning("clipshard: %s", line)
            return line
        if entry is not None and entry.name in self.rejected:
            return (f"{cls.__name__}: left alone, its structure is not the one clipshard patches "
                    f"({self.rejected[entry.name]}); it computes its own loss")
        if entry is not None and self.active:
            owner = next(c for c in cls.__mro__ if "forward" in c.__dict__)
            return (f"{cls.__name__}: left alone, its own {owner.__qualname__}.forward overrides {entry.name}'s and "
                    f"computes its own loss (clipshard's runs only if it calls {entry.name}.forward with "
                    "return_loss=True)")
        return f"{cls.__name__}: left alone, it computes its own loss"

    def undo(self):
        """Puts each class's own forward back (a no-op the second time)."""
        global _active
        if not self.active:
            return
        for cls, forward in self.originals.items():
            cls.forward = forward
        self.active = False
        if _active is self:
            _active = None
        _LOG.info("clipshard: transformers' own forwards restored (%s)", ", ".join(self.replaced))

    def summary(self):
        replaced = ", ".join(f"{name} ({family})" for name, family in self.replaced.items())
        logits = "" if self.logits else " without logits when return_loss=True"
        if self.micro_batch_size is not None:
            logits = f" through clipshard.GradCache in micro-batches of {self.micro_batch_size} when training"
        rejected = "".join(f"; left alone, structure not recognised: {name} ({why})"
                           for name, why in self.rejected.items())
        absent = f"; not in this transformers: {', '.join(self.absent)}" if self.absent else ""
        return (f"clipshard's global-batch loss in transformers' {replaced or 'no class'}{logits}{rejected}"
                f"{absent}; left alone (their own losses): {', '.join(self.kept)}")


_active = None


def apply_to_transformers(*, logits=True, micro_batch_size=None):
    """Makes `model(..., return_loss=True)` of transformers' CLIPModel, MetaClip2Model,
    ChineseCLIPModel, AltCLIPModel, VisionTextDualEncoderModel, SiglipModel and Siglip2Model (and
    their subclasses that keep the forward) return clipshard's loss over the global batch when
    torch.distributed is initialised (per rank w_r * L_r, whose gradients after DDP's average are
    the full-batch gradient; docs/transformers.md), and clipshard's fused single-device loss
    otherwise, with the models' own normalisation, logit_scale.exp() and SigLIP's logit_bias.
    Calls without return_loss are the models' own forward, unchanged.

    logits=False: with return_loss=True the forwards skip the M x M logits (logits_per_image /
    logits_per_text are None), so training memory stays O(M x D); evaluation calls (no
    return_loss) still return them.

    micro_batch_size=m: with grad enabled (training), return_loss=True runs the towers in
    micro-batches of m through clipshard.GradCache (the loss once on the whole local batch, the
    towers re-run per micro-batch in backward), so the step's memory stops growing with the batch;
    the output then holds the loss only (no embeddings, no logits). Without grad (evaluation) the
    forward is as above. docs/grad_cache.md.

    Call it before Trainer / accelerator.prepare / DDP wrap the model. Returns a TransformersPatch
    (`.replaced`, `.kept`, `.rejected`, `.absent`, `.covers(model)`, `.report(model)`, `.summary()`,
    `.undo()`) and logs its summary to the "clipshard" logger. Calling it again while applied, with
    the same `logits`, returns the same patch. Other models (`.kept`) are left as they are and raise
    nothing.

    Versions (supported_import.TRANSFORMERS): ImportError if transformers is missing or older than
    4.50. Each class is checked for the structure the patch uses (transformers_structure.problem);
    one that fails is left alone and listed in `.rejected`, never patched. A release newer than the
    newest tested gets one UserWarning naming its version, after that check."""
    global _active
    if not isinstance(logits, bool):
        raise TypeError(f"{_FN}: logits must be True or False, got {logits!r}")
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int)
                                         or micro_batch_size < 1):
        raise ValueError(f"{_FN}: micro_batch_size must be None or an int >= 1, got {micro_batch_size!r}")
    if _active is not None:
        if (_active.logits, _active.micro_batch_size) != (logits, micro_batch_size):
            raise ValueError(f"{_FN}: already applied with logits={_active.logits}, micro_batch_size="
                             f"{_active.micro_batch_size}; undo() that patch first")
        return _active
    transformers = import_transformers()
    originals, replaced, rejected, absent = {}, {}, {}, []
    for entry in models.COVERED:
        cls = entry.model_class_if_present()
        problem = None if cls is None else structure.problem(entry, cls)
        if cls is None:
            absent.append(entry.name)
        elif problem is not None:
            rejected[entry.name] = problem
        else:
            originals[cls] = unpatched(cls.__dict__["forward"])
            replaced[entry.name] = entry.family
    if replaced:
        TRANSFORMERS.warn_if_newer_than_tested(_FN, transformers)
    # every replacement is built before any class changes: an error leaves every class as it was
    forwards = {cls: _with_global_loss(forward, models.covered_entry(cls)) for cls, forward in originals.items()}
    for cls, forward in forwards.items():
        cls.forward = forward
    _active = TransformersPatch(replaced=replaced, kept=models.NOT_COVERED, logits=logits, originals=originals,
                                rejected=rejected, absent=tuple(absent), micro_batch_size=micro_batch_size)
    _LOG.info("clipshard: %s", _active.summary())
    if rejected:
        _LOG.warning("clipshard: left alone, their structure is not the one clipshard patches: %s",
                     "; ".join(f"{name} ({why})" for name, why in rejected.items()))
    return _active
