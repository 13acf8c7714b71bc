"""open_clip_train's `--accum-freq K` as a clipshard.GradCache step (used by
`python -m clipshard.open_clip_train`).

open_clip_train's own accumulation caches the features of K micro-batches, then re-runs each with
grad and evaluates the loss of the whole accumulated batch once per micro-batch: K loss
evaluations (and K gradient reductions over ranks) per step. Here the step is one batch of K x
--batch-size pairs through GradCache with micro-batches of --batch-size: the same pairs, the same
learning-rate schedule, the loss evaluated once. open_clip_train's train_one_epoch runs unchanged
with two stand-ins: a model whose call returns GradCache's loss (and logit_scale, which it logs)
and a loss that hands that on. docs/grad_cache.md.
"""
import logging

from clipshard.grad_cache import GradCache

_LOG = logging.getLogger("clipshard")


def one_batch_per_step(parse_args, accum_freq):
    """open_clip_train's parse_args, with --batch-size B --accum-freq K read as one batch of K x B
    per step (accum_freq 1): the data loader then yields each step's K micro-batches as one."""
    def parse(argv):
        args = parse_args(argv)
        args.batch_size *= accum_freq
        args.accum_freq = 1
        return args
    return parse


class _CachedStep:
    """What train_one_epoch calls as `model` and `loss`."""

    def __init__(self, model, loss, micro_batch_size):
        self.model, self.module = model, getattr(model, "module", model)  # .module: its unwrap_model
        self.open_clip_loss = loss
        self.cache = GradCache(model, self._loss_terms, micro_batch_size)
        self.terms, self.logit_scale = {}, None

    def _loss_terms(self, **outputs):
        terms = self.open_clip_loss(**outputs, output_dict=True)
        self.terms = {name: value.detach() for name, value in terms.items()}
        self.logit_scale = outputs["logit_scale"].detach()
        return terms  # GradCache sums them

    def __call__(self, images, texts):
        loss = self.cache(images, texts)
        return {"loss": loss, "logit_scale": self.logit_scale}

    def loss(self, loss, logit_scale, output_dict=True):
        """The loss terms open_clip's loss returned, the first carrying the step's gradient (its value
        minus the other terms' values), so that their sum is GradCache's loss."""
        names = list(self.terms)
        others = sum(self.terms[name] for name in names[1:])
        return {names[0]: loss - others, **{name: self.terms[name] for name in names[1:]}}

    def __getattr__(self, name):  # train(), eval(), ... of the wrapped model
        return getattr(self.model, name)


def grad_cache_epochs(train_one_epoch, micro_batch_size):
    """open_clip_train's train_one_epoch, run with a GradCache step of micro-batches of
    micro_batch_size rows."""
    def run(model, data, loss, epoch, optimizer, scaler, scheduler, dist_model, args, tb_writer=None):
        step = _CachedStep(model, loss, micro_batch_size)
        _LOG.info("clipshard: --accum-freq runs as clipshard.GradCache: local batch %d per step in micro-batches "
                  "of %d, the loss evaluated once per step", args.batch_size, micro_batch_size)
        return train_one_epoch(step, data, step.loss, epoch, optimizer, scaler, scheduler, dist_model, args,
                               tb_writer=tb_writer)
    return run
