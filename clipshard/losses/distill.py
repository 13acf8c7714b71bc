"""`DistillClipLoss`: a drop-in for open_clip's DistillClipLoss (the contrastive loss plus the
cross-entropy of the student's logits against a teacher's softmax), fused and sharded, for one
teacher or an ensemble of teachers (docs/distillation.md)."""
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from clipshard.losses import base
from clipshard.ops import check_algorithm
from clipshard.ops.compile_marks import constant_under_compile
from clipshard.ops.distill_lse import ALGORITHMS
from clipshard.ops.inputs import SUPPORTED_DTYPES, Problem, check_flags
from clipshard.parallel import distill_exchange
from clipshard.parallel import steady_state
from clipshard.parallel.agreement import exchange_rows, require_same
from clipshard.parallel.layout import metadata_device
from clipshard.ops.planned_device import tracing_a_plan
from clipshard.parallel.steady_state import check_validate


def _as_list(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _teacher_problem(image, teacher_images, teacher_texts, teacher_scales):
    """The first Problem with the teachers' inputs (the student's are valid), or None."""
    if not (len(teacher_images) == len(teacher_texts) == len(teacher_scales)) or not teacher_images:
        return Problem(ValueError, "dist_image_features, dist_text_features and dist_logit_scale must be one "
                       "teacher's or lists of the same length >= 1", f"{len(teacher_images)}, {len(teacher_texts)} "
                       f"and {len(teacher_scales)} teachers")
    for k, (t_image, t_text, t_scale) in enumerate(zip(teacher_images, teacher_texts, teacher_scales)):
        which = f"teacher {k}: " if len(teacher_images) > 1 else ""
        for name, t in (("dist_image_features", t_image), ("dist_text_features", t_text)):
            if not torch.is_tensor(t):
                return Problem(TypeError, f"{which}{name} must be a tensor", type(t).__name__)
            if t.dtype not in SUPPORTED_DTYPES:
                return Problem(TypeError, f"{which}{name} must be float32, float16, bfloat16 or float64", f"{t.dtype}")
            if t.device != image.device:
                return Problem(ValueError, f"{which}{name} must be on the students' device ({image.device})",
                               f"{t.device}")
        if t_image.dim() != 2 or t_image.shape != t_text.shape or t_image.shape[1] == 0:
            return Problem(ValueError, f"{which}dist_image_features and dist_text_features must have the same shape "
                           "(batch x teacher dim, dim >= 1)", f"{tuple(t_image.shape)} and {tuple(t_text.shape)}")
        if t_image.shape[0] != image.shape[0]:
            return Problem(ValueError, f"{which}the teacher's batch must be the student's ({image.shape[0]} rows)",
                           f"{t_image.shape[0]}")
        if t_image.dtype != t_text.dtype or t_image.dtype != teacher_images[0].dtype:
            return Problem(TypeError, f"{which}every teacher feature tensor must have one dtype",
                           f"{t_image.dtype}, {t_text.dtype} and {teacher_images[0].dtype}")
        number = isinstance(t_scale, (int, float)) and not isinstance(t_scale, bool)
        if not number and not (torch.is_tensor(t_scale) and t_scale.numel() == 1 and t_scale.is_floating_point()
                               and t_scale.device == image.device):
            got = (f"shape {tuple(t_scale.shape)}, {t_scale.dtype} on {t_scale.device}" if torch.is_tensor(t_scale)
                   else type(t_scale).__name__)
            return Problem(TypeError, f"{which}dist_logit_scale must be a float or a one-element floating-point "
                           "tensor on the features' device", got)
    return None


def _stack_after_softmax(images, texts, scales):
    """T teachers as the op's stack (T x M x Dt, T x K x Dt, T scales, no row weights): features of
    a smaller dimension are padded with zeros, which leaves every dot product unchanged."""
    dim = max(t.shape[1] for t in images)
    pad = lambda t: torch.nn.functional.pad(t, (0, dim - t.shape[1]))  # noqa: E731
    return (torch.stack([pad(t) for t in images]), torch.stack([pad(t) for t in texts]),
            torch.stack([s.reshape(()) for s in scales]), None)


def _stack_logit_mean(images, texts, scales):
    """The mean of T teachers' logits as ONE teacher: sum_k (s_k / T) <I_k, T_k> = (s_0 / T) <w I', T'>
    with I' = concat_k I_k and T' = concat_k T_k along the features, and the row weights w equal to
    s_k / s_0 on teacher k's features (applied to the rows of each op call, after any gather, so
    that the scales' gradients keep every term)."""
    if len(images) == 1:
        return _stack_after_softmax(images, texts, scales)
    first = scales[0].reshape(())
    weights = torch.cat([(s.reshape(()) / first).expand(t.shape[1]) for t, s in zip(images, scales)])
    return (torch.cat(images, dim=1).unsqueeze(0), torch.cat(texts, dim=1).unsqueeze(0),
            (first / len(images)).reshape(1), weights)


def _check_teachers_agree(fn, group, images, texts, scales, same_scales, validate):
    """Raise on every rank if the ranks' teachers differ (the teacher count already agrees): per
    teacher its feature dimension, dtypes and requires_grad pattern, and with same_scales its
    logit scale's value. validate="on_change": as base.shard_layout's, in a slot of its own; under
    torch.compile the host check runs while dynamo traces and the graph checks the header."""
    fields = []
    for t_image, t_text, t_scale in zip(images, texts, scales):
        fields += [t_image.shape[1], base.DTYPE_CODES[t_image.dtype], base.DTYPE_CODES.get(t_scale.dtype, -1),
                   base.requires_grad_bits((t_image, t_text, t_scale))]
    if tracing_a_plan():  # a memory plan: every rank holds this rank's teachers
        return
    if torch.compiler.is_compiling():
        key = tuple(len(range(f)) if f >= 0 else f for f in fields)  # sizes static (base._layout_while_compiling)
        ranks, tag = tuple(dist.get_process_group_ranks(group)), c10d._get_group_tag(group)
        keys = _teachers_while_tracing(fn, tag, ranks, key)
        steady_state.check_on_device(fn, group, keys, scales, same_scales)
        return
    if validate == "on_change" and steady_state.steady(fn, group, (0, *fields), scales, same_scales, "teachers"):
        return
    _teachers_on_host(fn, group, fields, scales, same_scales, validate)


def _teachers_on_host(fn, group, fields, scales, same_scales, validate):
    """The teachers' metadata exchange and its checks on the host (4 fields per teacher)."""
    table, values = exchange_rows(fn, group, fields, scales)
    n_teachers = len(scales)
    for k in range(n_teachers):
        which = f"teacher {k}'s" if n_teachers > 1 else "teacher's"
        for j, (what, shown) in enumerate(((f"{which} feature dimension", {}),
                                           (f"{which} feature dtype", base.DTYPE_NAMES),
                                           (f"{which} dist_logit_scale dtype", base.DTYPE_NAMES),
                                           (f"{which} requires_grad pattern of (dist_image_features, "
                                            "dist_text_features, dist_logit_scale) under the grad mode", {}))):
            require_same(fn, [row[4 * k + j] for row in table], what, shown)
    if same_scales:
        for k in range(n_teachers):
            name = f"dist_logit_scale (teacher {k})" if n_teachers > 1 else "dist_logit_scale"
            base.require_same_values(fn, name, [row[k] for row in values])
    if validate == "on_change":
        steady_state.remember(fn, group, [(0, *row) for row in table], metadata_device(group), True, "teachers")


@constant_under_compile
def _teachers_while_tracing(fn, tag, ranks, key):
    """The validated teachers' rows (steady_state.known_keys) for the compiled graph's header check;
    the host check first when this rank's row is not the validated one (the scales' values travel as
    NaN: the graph compares them)."""
    group = c10d._find_pg_by_ranks_and_tag(tag, list(ranks))
    if steady_state.known_result(fn, group, (0, *key), "teachers") is None:
        _teachers_on_host(fn, group, list(key), [None] * (len(key) // 4), False, "on_change")
    return steady_state.known_keys(fn, group, "teachers")


class DistillClipLoss(torch.nn.Module):
    """Drop-in replacement for open_clip.loss.DistillClipLoss (open_clip 3.3 signature): the CLIP
    contrastive loss and the distillation loss, the cross-entropy of the student's logits (rows and
    columns) against the teacher's softmax, with the same values and gradients as open_clip's for
    all four (local_loss, gather_with_grad) combinations; no logit matrix of the student or of any
    teacher is formed.

    Arguments as clipshard.ClipLoss (mode "exchange", "local" or "ring"; the default follows
    gather_with_grad as there), plus average_after_softmax: for an ensemble of teachers (lists of
    features and scales in forward), the target of each row is the mean of the teachers' softmaxes
    (True, MobileCLIP's ensemble) or the softmax of the mean of their logits (False). algorithm:
    "auto", "compiled" or "torch" (clipshard.ops.distill_lse). validate: see clipshard.clip_loss.
    Horovod is not supported.
    """

    def __init__(self, local_loss=False, gather_with_grad=False, cache_labels=False, rank=0, world_size=1,
                 use_horovod=False, *, mode=None, group=None, algorithm="auto", average_after_softmax=False,
                 validate="every_call"):
        super().__init__()
        fn = "DistillClipLoss"
        check_flags(fn, cache_labels=cache_labels, use_horovod=use_horovod,
                    average_after_softmax=average_after_softmax)
        base.check_rank_and_world_size(fn, rank, world_size)
        base.check_horovod(fn, use_horovod)
        self.local_loss, self.gather_with_grad, self.cache_labels = local_loss, gather_with_grad, cache_labels
        self.rank, self.world_size, self.use_horovod = rank, world_size, use_horovod
        self.mode = base.resolve_mode(fn, mode, local_loss, gather_with_grad)
        self.group = group
        check_algorithm(fn, algorithm, ALGORITHMS)
        self.algorithm = algorithm
        self.average_after_softmax = average_after_softmax
        check_validate(fn, validate)
        self.validate = validate

    def forward(self, image_features, text_features, logit_scale, dist_image_features, dist_text_features,
                dist_logit_scale, output_dict=False):
        """(contrastive_loss, distill_loss) of this rank's batch, as open_clip's
        DistillClipLoss.forward computes them ({"contrastive_loss", "distill_loss"} with output_dict).

        image_features, text_features: the student's (batch, dim) features, one dtype and device.
        logit_scale: the student's logit scale, already exponentiated (tensor or number).
        dist_image_features, dist_text_features: the teacher's (batch, teacher dim) features (any
            supported dtype, the teacher dim may differ from the student's), or lists of them, one
            per teacher.
        dist_logit_scale: the teacher's logit scale (already exponentiated), or a list, one per teacher.
        Returns two 0-dim fp32 tensors (fp64 for fp64 student features).
        """
        fn = "DistillClipLoss"
        check_flags(fn, output_dict=output_dict)
        images, texts = _as_list(dist_image_features), _as_list(dist_text_features)
        scales = _as_list(dist_logit_scale)
        distributed = not (self.world_size == 1 and self.group is None)
        group = base.resolve_group(fn, self.group, self.world_size) if distributed else None
        scale = base.as_scalar_tensor(logit_scale, image_features)
        valid = base.input_problem(image_features, text_features, scale, None) is None
        teacher_problem = _teacher_problem(image_features, images, texts, scales) if valid else None
        scales = [base.as_scalar_tensor(s, image_features) for s in scales]
        explicit = distributed and not (self.world_size == 1 and self.rank == 0)
        options = base.Options("the distillation loss", self.mode, local_loss=self.local_loss,
                               gather_with_grad=self.gather_with_grad, teachers=len(images),
                               average_after_softmax=self.average_after_softmax)
        mixes = base.mixes_ranks_scales(self.local_loss, self.mode)
        layout = base.shard_layout(
            fn, image_features, text_features, scale, None, group, options,
            rank_arg=self.rank if explicit else None, world_size_arg=self.world_size if explicit else None,
            same_scale_and_bias=mixes, own_problem=teacher_problem, validate=self.validate)
        if group is not None:  # the teachers must agree across ranks too (their count does already)
            _check_teachers_agree(fn, group, images, texts, scales, mixes, self.validate)
        stack = _stack_after_softmax if self.average_after_softmax else _stack_logit_mean
        n = len(images)
        teachers = (images + texts + scales, lambda *leaves: stack(leaves[:n], leaves[n:2 * n], leaves[2 * n:]))
        if self.local_loss or layout.world_size == 1:
            losses = distill_exchange.rank_losses(teachers, image_features, text_features, scale, layout,
                                                  self.mode if layout.world_size > 1 else "exchange",
                                                  self.gather_with_grad, self.algorithm)
        else:
            losses = distill_exchange.global_losses(teachers, image_features, text_features, scale, layout,
                                                    self.mode, self.gather_with_grad, self.algorithm,
                                                    sync_free=self.validate == "on_change")
        contrastive, distill = losses.unbind()
        if output_dict:
            return {"contrastive_loss": contrastive, "distill_loss": distill}
        return contrastive, distill
