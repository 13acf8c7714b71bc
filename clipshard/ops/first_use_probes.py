"""The first-use check's problems (clipshard/ops/first_use.py, docs/first_use.md): one Probe per
kernel family, and for the losses the variants a call can run.

A variant is a tuple of (choice, value) pairs, every choice that selects a different compiled path:

- contrastive_lse: the chunked forward's rows per CTA (chunk_forward_kernel<16 or 32, ...>), sample
  ids (targets "mask": the <..., true> kernels), positives or none (pos_offset -1: hard negatives,
  foreign ring blocks) and the column direction (col_lse, its gradient);
- siglip_sum: ids (none, "multi" or "mask") with the rows per CTA of the kernel with ids, positives
  or none, and with_grad (siglip_chunk_kernel<DL, true or false>);
- distill_lse: the teachers per forward launch (distill_forward_kernel<1>, <2> or both), the column
  statistics, and the teachers' gradients.

The launch choices come from the launchers' own rules (clipshard/ops/launch_variants.py), and each
probe builds a problem that those rules map to its variant: SigLIP's rows per CTA through the
number of rows (on an H100, 8 rows per CTA take M >= 4217), the forward's rows per CTA through
CLIPSHARD_CHUNKED_FORWARD_ROWS where M alone cannot reach it. A path is what a call knows before
it runs: (rows, ids, positives, col_lse), (rows, ids, positives, with_grad), (teachers,
want_columns, teacher_grad); rows (or teachers) None, as while torch.compile traces, stands for
every number.
"""
import contextlib
import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from clipshard.ops import launch_variants
from clipshard.ops.portable_distill import distill_lse_backward_torch, distill_lse_torch
from clipshard.ops.portable_lse import contrastive_lse_backward_torch, contrastive_lse_torch
from clipshard.ops.portable_siglip import siglip_block_torch
from clipshard.ops.seeds import as_int64

# The small problem: odd sizes, 300 columns in 3 chunks of the narrowest width (a 1-byte workspace).
M, K, D, POS_OFFSET, TEACHER_D = 67, 300, 40, 41, 24
WORKSPACE = 1
SCALE, BIAS, TEACHER_SCALES = 14.3, -2.5, (11.0, 23.0, 17.0)
SEED, OFFSET = as_int64(0xC11F_5EED_9ABC_DEF0), 77  # a Philox key with its high bit set


def _no_variants(device, path):
    return ((),)


def _only_the_plain_variant(device):
    return ((),)


def _nothing_to_set(variant):
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Probe:
    """One kernel family's first-use problem. inputs(dtypes, variant, device) -> CPU tensors;
    compiled(algorithm, dtypes, variant, *inputs) and reference(dtypes, variant, *inputs) -> lists of
    outputs. exact: the reference runs on CPU copies and the bits must match; else it runs on the
    device, in the dtypes and in fp64. variants(device, path) -> the variants a call's path runs;
    every_variant(device) -> all of them (python -m clipshard checks each); reaching(variant) -> a
    context, around the compiled run, in which the launch rules give the variant for the inputs'
    sizes (beyond what the sizes alone do)."""
    inputs: Callable
    compiled: Callable
    reference: Callable
    exact: bool
    fallback: str  # what runs after a failed check, for the warning
    variants: Callable = _no_variants
    every_variant: Callable = _only_the_plain_variant
    reaching: Callable = _nothing_to_set


def describe(variant):
    return ", ".join(f"{name}={value}" for name, value in variant)


def _features(n, dtype, generator, *lead):
    """Unit-norm rows (CLIP's features are normalised), drawn in fp64 on the CPU."""
    x = torch.randn(*lead, n, D if not lead else TEACHER_D, dtype=torch.float64, generator=generator, device="cpu")
    return (x / x.norm(dim=-1, keepdim=True)).to(dtype)


def _upstream(m, generator, *shapes):
    """Gradients of about 0.5 / m, as a mean over the batch gives."""
    return [(0.5 / m) * (torch.rand(s, dtype=torch.float64, generator=generator, device="cpu") + 0.5).float()
            for s in shapes]


def _scalar(value):
    return torch.tensor(value, dtype=torch.float32, device="cpu")


def _sample_ids(m, k, positives, generator):
    """(row ids [m], col ids [k]) with repeats; with positives each row's id is its positive's."""
    col_ids = torch.randint(0, max(k // 3, 2), (k,), generator=generator, device="cpu")
    if positives:
        return col_ids[POS_OFFSET:POS_OFFSET + m].clone(), col_ids
    return torch.randint(0, max(k // 3, 2), (m,), generator=generator, device="cpu"), col_ids


def _pos_offset(v):
    return POS_OFFSET if v["positives"] else None


def _schema_pos_offset(v):
    return POS_OFFSET if v["positives"] else -1


# --- contrastive_lse ------------------------------------------------------------------------------

def _lse_variants(device, path):
    rows, ids, positives, col_lse = path
    choices = ((launch_variants.chunked_forward_rows(rows),) if rows is not None
               else launch_variants.every_forward_rows())
    return tuple((("forward_rows", r), ("ids", ids), ("positives", positives), ("col_lse", col_lse)) for r in choices)


def _every_lse_variant(device):
    """On CUDA every forward rows per CTA; elsewhere (no such launch choice) the rule's default for M
    rows, whatever CLIPSHARD_CHUNKED_FORWARD_ROWS says where no kernel reads it."""
    if device.type == "cuda":
        choices = launch_variants.every_forward_rows()
    else:
        with launch_variants.forward_rows_requested(None):
            choices = (launch_variants.chunked_forward_rows(M),)
    return tuple((("forward_rows", r), ("ids", ids), ("positives", p), ("col_lse", c)) for r, ids, p, c in
                 itertools.product(choices, (False, True), (True, False), (True, False)))


def _lse_inputs(dtypes, variant, device):
    v = dict(variant)
    g = torch.Generator(device="cpu").manual_seed(1)
    rows, cols = _features(M, dtypes[0], g), _features(K, dtypes[0], g)
    ids = _sample_ids(M, K, v["positives"], g) if v["ids"] else ()
    return (rows, cols, _scalar(SCALE), _scalar(BIAS), *_upstream(M, g, M, M, K), *ids)


@contextlib.contextmanager
def _lse_reaching(variant):
    """The probe's M runs the variant's forward rows per CTA: CLIPSHARD_CHUNKED_FORWARD_ROWS is set
    to the variant's rows while the probe runs (the rule gives the requested rows for M rows), so the
    probe reaches its variant whatever the caller's value."""
    rows = dict(variant)["forward_rows"]
    with launch_variants.forward_rows_requested(rows):
        if launch_variants.chunked_forward_rows(M) != rows:
            raise ValueError(f"the probe cannot reach the forward variant of {rows} rows per CTA")
        yield


def _lse_outputs(v, outs, grads):
    """The outputs a call of the variant uses: no pos_logit without positives (NaN), no col_lse
    without the column direction (empty)."""
    row_lse, pos_logit, col_lse = outs
    return ([row_lse] + ([pos_logit] if v["positives"] else []) + ([col_lse] if v["col_lse"] else [])
            + list(grads))


def _lse_compiled(algorithm, dtypes, variant, rows, cols, scale, bias, g_row, g_pos, g_col, *ids):
    v = dict(variant)
    row_ids, col_ids = ids or (None, None)
    outs = torch.ops.clipshard.contrastive_lse_forward(rows, cols, scale, bias, _schema_pos_offset(v), row_ids,
                                                       col_ids, v["col_lse"], algorithm, WORKSPACE)
    col_lse = outs[2] if v["col_lse"] else None
    grads = torch.ops.clipshard.contrastive_lse_backward(g_row, g_pos, g_col if v["col_lse"] else None, rows, cols,
                                                         scale, bias, _schema_pos_offset(v), row_ids, col_ids,
                                                         outs[0], col_lse, algorithm, WORKSPACE)
    return _lse_outputs(v, outs, grads)


def _lse_torch(dtypes, variant, rows, cols, scale, bias, g_row, g_pos, g_col, *ids):
    v = dict(variant)
    row_ids, col_ids = ids or (None, None)
    outs = contrastive_lse_torch(rows, cols, scale, bias, _pos_offset(v), v["col_lse"], WORKSPACE, row_ids, col_ids)
    col_lse = outs[2] if v["col_lse"] else None
    grads = contrastive_lse_backward_torch(g_row, g_pos, g_col if v["col_lse"] else None, rows, cols, scale, bias,
                                           _pos_offset(v), outs[0], col_lse, WORKSPACE, row_ids, col_ids)
    return _lse_outputs(v, outs, grads)


# --- siglip_sum -----------------------------------------------------------------------------------

_SIGLIP_IDS = (None, "multi", "mask")  # no ids; labels by id; same-id pairs without a term


def _siglip_rows_choices(device, rows, ids):
    """The rows per CTA a call runs: None for the kernel without ids or a device without the CUDA
    rule, else the rule's answer for `rows` (every answer when rows is None)."""
    multiprocessors = launch_variants.multiprocessors(device)
    if ids is None or multiprocessors is None:
        return (None,)
    if rows is None:
        return launch_variants.every_siglip_ids_rows(multiprocessors)
    return (launch_variants.siglip_ids_rows(rows, multiprocessors),)


def _siglip_variant(ids, rows_per_cta, positives, with_grad):
    return (("ids", ids), ("rows_per_cta", rows_per_cta), ("positives", positives), ("with_grad", with_grad))


def _siglip_variants(device, path):
    rows, ids, positives, with_grad = path
    return tuple(_siglip_variant(ids, r, positives, with_grad) for r in _siglip_rows_choices(device, rows, ids))


def _every_siglip_variant(device):
    return tuple(_siglip_variant(ids, r, p, w) for ids in _SIGLIP_IDS for r in _siglip_rows_choices(device, None, ids)
                 for p, w in itertools.product((True, False), (True, False)))


def _siglip_size(v, device):
    """(M, K, workspace bytes) of the probe: M = 67 unless the rows per CTA need another M on this
    device (then K holds the positives and the workspace gives a few wide chunks, not dozens)."""
    if v["rows_per_cta"] is None:
        return M, K, WORKSPACE
    multiprocessors = launch_variants.multiprocessors(device)
    m = launch_variants.rows_reaching(lambda n: launch_variants.siglip_ids_rows(n, multiprocessors),
                                      v["rows_per_cta"], M)
    k = max(K, m + POS_OFFSET + 20)
    return m, k, WORKSPACE if k == K else 4 * m * math.ceil(k / 3)


def _siglip_inputs(dtypes, variant, device):
    v = dict(variant)
    m, k, _ = _siglip_size(v, device)
    g = torch.Generator(device="cpu").manual_seed(2)
    rows, cols = _features(m, dtypes[0], g), _features(k, dtypes[0], g)
    ids = _sample_ids(m, k, v["positives"], g) if v["ids"] else ()
    return (rows, cols, _scalar(SCALE), _scalar(BIAS), *ids)


def _siglip_compiled(algorithm, dtypes, variant, rows, cols, scale, bias, *ids):
    v = dict(variant)
    row_ids, col_ids = ids or (None, None)
    workspace = _siglip_size(v, rows.device)[2]
    return list(torch.ops.clipshard.siglip_forward(rows, cols, scale, bias, _pos_offset(v), row_ids, col_ids,
                                                   v["ids"] == "mask", v["with_grad"], workspace))


def _siglip_torch(dtypes, variant, rows, cols, scale, bias, *ids):
    # the torch path keeps the sum's gradients in fp32 here: a reference a little more exact than
    # the op's own 16-bit ones, well within the 16-bit floors
    v = dict(variant)
    row_ids, col_ids = ids or (None, None)
    workspace = _siglip_size(v, rows.device)[2]
    return list(siglip_block_torch(rows, cols, scale, bias, _pos_offset(v), v["with_grad"], workspace, torch.float32,
                                   row_ids, col_ids, v["ids"] == "mask"))


# --- distill_lse ----------------------------------------------------------------------------------

def _distill_variant(launches, want_columns, teacher_grad):
    return (("teachers_per_launch", launches), ("want_columns", want_columns), ("teacher_grad", teacher_grad))


def _distill_variants(device, path):
    teachers, want_columns, teacher_grad = path
    patterns = ((launch_variants.distill_launch_teachers(teachers),) if teachers is not None
                else launch_variants.every_distill_launch_teachers())
    return tuple(_distill_variant(launches, want_columns, teacher_grad) for launches in patterns)


def _every_distill_variant(device):
    return tuple(_distill_variant(launches, c, t) for launches in launch_variants.every_distill_launch_teachers()
                 for c, t in itertools.product((True, False), (True, False)))


def _teachers(v):
    """The fewest teachers whose launches are the variant's (1, 2 or 3)."""
    for t in range(1, 6):
        if launch_variants.distill_launch_teachers(t) == v["teachers_per_launch"]:
            return t
    raise ValueError(f"no number of teachers gives the launches {v['teachers_per_launch']}")


def _distill_inputs(dtypes, variant, device):
    student, teacher = dtypes
    t = _teachers(dict(variant))
    g = torch.Generator(device="cpu").manual_seed(3)
    return (_features(M, student, g), _features(K, student, g), _features(M, teacher, g, t),
            _features(K, teacher, g, t), _scalar(SCALE), torch.tensor(TEACHER_SCALES[:t], device="cpu"),
            *_upstream(M, g, M, M, (t, M), (t, M), K, (t, K), (t, K)))


def _distill_upstream(v, upstream):
    return list(upstream) if v["want_columns"] else list(upstream[:4]) + [None] * 3


def _distill_compiled(algorithm, dtypes, variant, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale,
                      *upstream):
    v = dict(variant)
    outs = torch.ops.clipshard.distill_lse(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, POS_OFFSET,
                                           v["want_columns"], WORKSPACE)
    stats = outs[:1] + outs[2:]
    grads = torch.ops.clipshard.distill_lse_backward(*_distill_upstream(v, upstream), rows, cols, teacher_rows,
                                                     teacher_cols, scale, teacher_scale, POS_OFFSET, *stats,
                                                     v["teacher_grad"], WORKSPACE)
    return [*outs, *grads]


def _distill_torch(dtypes, variant, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, *upstream):
    v = dict(variant)
    outs = distill_lse_torch(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, POS_OFFSET,
                             v["want_columns"], WORKSPACE)
    stats = outs[:1] + outs[2:]
    grads = distill_lse_backward_torch(_distill_upstream(v, upstream), rows, cols, teacher_rows, teacher_cols, scale,
                                       teacher_scale, POS_OFFSET, stats, v["teacher_grad"], WORKSPACE)
    return [*outs, *grads]


# --- stochastic rounding, AdamW: one variant each ---------------------------------------------------

def _rounding_inputs(dtypes, variant, device):
    """fp32 values over the whole range and the special ones (NaN, infinities, zeros, fp16
    overflow, subnormals), as 3 x 337."""
    g = torch.Generator(device="cpu").manual_seed(4)
    x = torch.randn(1001, dtype=torch.float64, generator=g, device="cpu")
    x = x * 10.0 ** torch.randint(-8, 5, (1001,), generator=g, device="cpu")
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e-6, -4e-8, 65519.0, 65520.0,
                             1e-39], dtype=torch.float32, device="cpu")
    return (torch.cat([specials, x.float()]).reshape(3, 337),)


def _rounding(algorithm, dtypes, variant, x):
    """Both entry points and both kernels: stochastic_round (not saturating, saturating; aligned
    memory: the vectorised kernel), of a view one element in (unaligned: the scalar kernel), and
    stochastic_round_into a transposed (strided) destination."""
    (dtype,) = dtypes
    into = torch.empty(337, 3, dtype=dtype, device=x.device).t()
    torch.ops.clipshard.stochastic_round_into(into, x, SEED, OFFSET, False)
    unaligned = x.reshape(-1)[1:]
    return [torch.ops.clipshard.stochastic_round(x, dtype, SEED, OFFSET, saturate) for saturate in (False, True)] + [
        into, torch.ops.clipshard.stochastic_round(unaligned, dtype, SEED, OFFSET, False)]


_ADAMW_SIZES, _ADAMW_NUMBERS, _ADAMW_BASES = (1, 37, 203), [0, 4, 9], [0, 5, 1026]


def _adamw_inputs(dtypes, variant, device):
    """Three tensors of (param, grad, exp_avg, second moment as stored); one gradient is a NaN."""
    param, state = dtypes
    g = torch.Generator(device="cpu").manual_seed(5)
    roles = [[], [], [], []]
    for n in _ADAMW_SIZES:
        values = [torch.randn(n, dtype=torch.float64, generator=g, device="cpu") * s for s in (1.0, 1e-2, 1e-3)]
        v = 1e-5 * torch.rand(n, dtype=torch.float64, generator=g, device="cpu")
        values.append(v ** 0.25 if state == torch.float16 else v)  # fp16 keeps v^(1/4)
        for role, value, dtype in zip(roles, values, (param, param, state, state)):
            role.append(value.to(dtype))
    roles[1][-1][7] = float("nan")
    return tuple(t for role in roles for t in role)


def _adamw(algorithm, dtypes, variant, *tensors):
    """Two steps on copies: stochastic rounding, and round-to-nearest with maximize."""
    params, grads, exp_avgs, exp_avg_sqs = (list(tensors[i:i + 3]) for i in range(0, 12, 3))
    outs = []
    for stochastic, maximize in ((True, False), (False, True)):
        p, m, v = ([t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs))
        torch.ops.clipshard.adamw_step_(p, grads, m, v, [3, 3, 3], 3e-3, 0.9, 0.999, 1e-8, 0.05, maximize, stochastic,
                                        SEED, OFFSET, _ADAMW_NUMBERS, _ADAMW_BASES)
        outs += p + m + v
    return outs


_TORCH_PATH = "the torch path (algorithm='torch': the same results, slower)"
_HOST_COPIES = "the CPU kernel on host copies (the same bits, much slower: a round trip to the host per call)"
PROBES = {
    "contrastive_lse": Probe(_lse_inputs, _lse_compiled, _lse_torch, False, _TORCH_PATH, _lse_variants,
                             _every_lse_variant, _lse_reaching),
    "siglip_sum": Probe(_siglip_inputs, _siglip_compiled, _siglip_torch, False, _TORCH_PATH, _siglip_variants,
                        _every_siglip_variant),
    "distill_lse": Probe(_distill_inputs, _distill_compiled, _distill_torch, False, _TORCH_PATH, _distill_variants,
                         _every_distill_variant),
    "stochastic_round": Probe(_rounding_inputs, _rounding, lambda dtypes, variant, *x: _rounding(None, dtypes, variant,
                                                                                                 *x), True,
                              _HOST_COPIES),
    "adamw_step_": Probe(_adamw_inputs, _adamw, lambda dtypes, variant, *x: _adamw(None, dtypes, variant, *x), True,
                         _HOST_COPIES),
}
