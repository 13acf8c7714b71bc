"""`python -m clipshard.open_clip_train [open_clip_train's arguments] [--clipshard-... options]`

Runs open_clip_train's own main() with apply_to_open_clip() in effect (clipshard's ClipLoss /
CoCaLoss), and with the paper's recipe as options:
  --clipshard-text-dtype bfloat16|float16   the trained model's text tower stored in 16 bits with
                                            stochastic rounding (text_tower_to_half_precision_)
  --clipshard-adamw                         clipshard.optim.AdamW (16-bit states for 16-bit
                                            parameters) in place of torch.optim.AdamW, with the
                                            hyper-parameters and param groups open_clip_train builds
and open_clip_train's own --accum-freq K runs as a clipshard.GradCache step (the loss evaluated once
per step instead of K times; open_clip_grad_cache.py).
It also lets open_clip_train's DDP run on CPU: open_clip_train passes device_ids=[device] for CPU
modules too, which torch refuses; here CPU device_ids become None (GPU runs are unaffected). And
open_clip_train 2.x's --resume works with torch >= 2.6 (numpy_scalars_loadable).
Everything is put back when main() returns. docs/open_clip.md.
"""
import argparse
import contextlib
import logging
import sys

import torch

from clipshard.integrations.open_clip_common import import_open_clip, warn_if_newer_than_tested
from clipshard.integrations.open_clip_grad_cache import grad_cache_epochs, one_batch_per_step
from clipshard.integrations.open_clip_patch import apply_to_open_clip

_PROG = "python -m clipshard.open_clip_train"
_LOG = logging.getLogger("clipshard")
_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_clipshard_args(argv):
    """(clipshard's options, the remaining arguments for open_clip_train)."""
    parser = argparse.ArgumentParser(prog=_PROG, add_help=False, allow_abbrev=False,
                                     description="open_clip_train with clipshard; the other arguments are "
                                                 "open_clip_train's own (see below).")
    parser.add_argument("--clipshard-text-dtype", choices=list(_DTYPES), default="float32",
                        help="dtype the text tower is stored in; bfloat16 / float16 round stochastically "
                             "(default float32: as open_clip builds it)")
    parser.add_argument("--clipshard-adamw", action="store_true",
                        help="clipshard.optim.AdamW in place of torch.optim.AdamW (same param groups and "
                             "hyper-parameters; moments in the parameters' dtype, fp32 for fp32 parameters)")
    options, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print()
    return options, rest


@contextlib.contextmanager
def _replaced(owner, name, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


class _CpuDeviceIdsDDP(torch.nn.parallel.DistributedDataParallel):
    """DistributedDataParallel that takes open_clip_train's device_ids=[cpu] as torch wants CPU
    modules to be given, device_ids=None."""

    def __init__(self, module, device_ids=None, *args, **kwargs):
        if device_ids is not None and all(torch.device(d).type == "cpu" for d in device_ids):
            device_ids = None
        super().__init__(module, device_ids, *args, **kwargs)


def _text_tower_hook(create_model_and_transforms, dtype):
    """create_model_and_transforms that converts the text tower of the first model it builds:
    open_clip_train builds the model it trains first (a --distill teacher second, left as built)."""
    from clipshard.integrations.open_clip_text_tower import text_tower_to_half_precision_
    calls = []

    def create(*args, **kwargs):
        model, *transforms = create_model_and_transforms(*args, **kwargs)
        if not calls:
            text_tower_to_half_precision_(model, dtype)
            count = sum(p.numel() for p in model.parameters() if p.dtype == dtype)
            _LOG.info("clipshard: text tower (%d parameters) stored in %s with stochastic rounding "
                      "(model class %s)", count, dtype, type(model).__name__)
        calls.append(True)
        return (model, *transforms)
    return create


class _OptimWithClipshardAdamW:
    """Stands in for torch.optim in open_clip_train.main, whose `optim.AdamW(groups, lr=, betas=,
    eps=)` then builds clipshard.optim.AdamW from the same groups and hyper-parameters."""

    def __getattr__(self, name):
        return getattr(torch.optim, name)

    @staticmethod
    def AdamW(params, *args, **kwargs):  # noqa: N802  (the name open_clip_train calls)
        from clipshard.optim import AdamW
        optimizer = AdamW(params, *args, **kwargs)
        groups = "; ".join(f"{len(g['params'])} params with weight_decay={g['weight_decay']}"
                           for g in optimizer.param_groups)
        _LOG.info("clipshard: clipshard.optim.AdamW in place of torch.optim.AdamW (lr=%s, betas=%s, eps=%s; %s)",
                  optimizer.defaults["lr"], optimizer.defaults["betas"], optimizer.defaults["eps"], groups)
        return optimizer


def _loss_hook(create_loss, patch):
    def create(args):
        loss = create_loss(args)
        _LOG.info("clipshard: create_loss built %s.%s (%s)", type(loss).__module__, type(loss).__qualname__,
                  patch.summary())
        return loss
    return create


def _check_options(options, args):
    opt = getattr(args, "opt", "adamw")  # open_clip_train before 3.0 has no --opt: always AdamW
    if options.clipshard_adamw and opt != "adamw":
        raise SystemExit(f"{_PROG}: --clipshard-adamw replaces open_clip_train's --opt adamw, got --opt {opt}")
    if options.clipshard_adamw and args.horovod:
        raise SystemExit(f"{_PROG}: --clipshard-adamw is not supported with --horovod")
    if args.accum_freq < 1:
        raise SystemExit(f"{_PROG}: --accum-freq must be >= 1 (the micro-batches of --batch-size in a step), "
                         f"got --accum-freq {args.accum_freq}")
    if args.accum_freq > 1 and (args.horovod or args.distill_model is not None):
        raise SystemExit(f"{_PROG}: --accum-freq (a clipshard.GradCache step) is not supported with "
                         f"{'--horovod' if args.horovod else '--distill-model'}")


def numpy_scalars_loadable():
    """torch.load's weights_only mode (torch's default from 2.6, which open_clip_train's pt_load uses
    for --resume) with numpy's scalars and dtypes allowed. open_clip_train 2.x's cosine schedule sets
    each param group's lr to a numpy float64 (np.cos), so its checkpoints hold numpy scalars, which
    weights_only refuses by default; they are data, not code. 3.x computes the lr with math.cos."""
    import numpy
    scalar_reconstructor = numpy.float64(0).__reduce__()[0]  # numpy 1 and 2 keep it in different modules
    return torch.serialization.safe_globals([scalar_reconstructor, numpy.dtype, type(numpy.dtype(numpy.float64))])


def _grad_cache_hooks(stack, train_main, args):
    """--accum-freq K: one batch of K x --batch-size per step through GradCache."""
    if args.accum_freq == 1:
        return
    stack.enter_context(_replaced(train_main, "parse_args", one_batch_per_step(train_main.parse_args, args.accum_freq)))
    stack.enter_context(_replaced(train_main, "train_one_epoch",
                                  grad_cache_epochs(train_main.train_one_epoch, args.batch_size)))


# what the entry point replaces inside open_clip_train.main, in every release from 2.26 (when
# open_clip_train became a package) to 3.3
_TRAIN_MAIN_NAMES = ("main", "create_loss", "create_model_and_transforms", "optim")


def _check_layout(open_clip, train_main):
    missing = [name for name in _TRAIN_MAIN_NAMES if not hasattr(train_main, name)]
    if missing:
        raise ImportError(f"{_PROG}: open_clip_train.main of open_clip_torch {open_clip.__version__} has no "
                          f"{', '.join(missing)}: its layout is not the one this entry point drives")
    warn_if_newer_than_tested(_PROG, open_clip)


def main(argv=None):
    """Runs open_clip_train.main.main with clipshard; returns what it returns."""
    options, open_clip_argv = parse_clipshard_args(sys.argv[1:] if argv is None else argv)
    open_clip = import_open_clip(_PROG)
    from open_clip_train import main as train_main  # its data module needs pandas etc.: the [open_clip] extra
    from open_clip_train.params import parse_args
    _check_layout(open_clip, train_main)
    args = parse_args(open_clip_argv)
    _check_options(options, args)
    patch = apply_to_open_clip()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_replaced(torch.nn.parallel, "DistributedDataParallel", _CpuDeviceIdsDDP))
            stack.enter_context(numpy_scalars_loadable())
            stack.enter_context(_replaced(train_main, "create_loss", _loss_hook(train_main.create_loss, patch)))
            _grad_cache_hooks(stack, train_main, args)
            dtype = _DTYPES[options.clipshard_text_dtype]
            if dtype is not None:
                hook = _text_tower_hook(train_main.create_model_and_transforms, dtype)
                stack.enter_context(_replaced(train_main, "create_model_and_transforms", hook))
            if options.clipshard_adamw:
                stack.enter_context(_replaced(train_main, "optim", _OptimWithClipshardAdamW()))
            return train_main.main(open_clip_argv)
    finally:
        patch.undo()


if __name__ == "__main__":
    sys.exit(main())
