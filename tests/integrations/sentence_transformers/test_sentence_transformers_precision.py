"""The patched sentence-transformers losses in mixed precision and with a learnable scale: the forward
under bf16 / fp16 autocast (backward inside and after the block) on every path of the fused loss, 16-bit
embeddings without autocast, and `loss.scale` as a tensor that requires grad. Each against the
library under the same conditions and the fp64 value of the same inputs."""
import itertools

import pytest
import torch

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed: "
                    "pip install '.[sentence_transformers]'")

import clipshard  # noqa: E402
from clipshard.integrations import sentence_transformers_columns  # noqa: E402
from tests.integrations.sentence_transformers.reference import per_row_losses  # noqa: E402
from tests.integrations.sentence_transformers.st_cases import global_batch  # noqa: E402

from sentence_transformers import util  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
# path -> (cached, directions, similarity); "recomputed" is the default options' path with nothing kept
PATHS = {"kept": (False, ("query_to_doc",), "cos_sim"), "recomputed": (False, ("query_to_doc",), "cos_sim"),
         "directions": (False, ALL, "cos_sim"), "dot_score": (False, ("query_to_doc",), "dot_score"),
         "cached": (True, ("query_to_doc",), "cos_sim")}
SCALE = {"cos_sim": 20.0, "dot_score": 1.0}
UPSTREAM = 0.5  # the loss's upstream gradient (a mean over rows already: the scale of a real one)


def _loss(path, scale=None):
    cached, directions, similarity = PATHS[path]
    kwargs = dict(scale=SCALE[similarity], similarity_fct=getattr(util, similarity), directions=directions)
    model = torch.nn.Sequential(torch.nn.Identity())
    loss = (losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2, **kwargs) if cached
            else losses.MultipleNegativesRankingLoss(model, **kwargs))
    if scale is not None:
        loss.scale = scale
    return loss


def _run(loss, columns, autocast_dtype=None, backward_inside=False):
    """(loss value, gradients of the columns) of one call as a user makes it: the forward under
    autocast when autocast_dtype is given, the backward inside or after the block."""
    leaves = [c.detach().clone().requires_grad_() for c in columns]
    cached = isinstance(loss, losses.CachedMultipleNegativesRankingLoss)
    reps = [[x.detach().requires_grad_() for x in leaf.split(2)] for leaf in leaves]
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        if cached:
            value = loss.calculate_loss(reps, None, with_backward=backward_inside) * UPSTREAM
        else:
            value = loss.compute_loss_from_embeddings(leaves, None) * UPSTREAM
        if backward_inside and not cached:
            value.backward()
    if not backward_inside:
        value.backward()
    grads = [torch.cat([r.grad for r in col]) for col in reps] if cached else [leaf.grad for leaf in leaves]
    upstream = 1.0 if cached and backward_inside else UPSTREAM  # with_backward: the loss's own backward
    return value.detach().double() / UPSTREAM, [g.double() * (UPSTREAM / upstream) for g in grads]


def _patched(fn, *args, **kwargs):
    patch = clipshard.apply_to_sentence_transformers()
    try:
        return fn(*args, **kwargs)
    finally:
        patch.undo()


def _reference(path, columns, scale=None):
    """The fp64 loss and gradients (columns, then the scale) of these very inputs."""
    _, directions, similarity = PATHS[path]
    leaves = [c.detach().double().requires_grad_() for c in columns]
    scale = torch.tensor(SCALE[similarity] if scale is None else float(scale), dtype=torch.float64,
                         requires_grad=True)
    value = per_row_losses(leaves[0], leaves[1:], scale=scale, cosine=similarity == "cos_sim",
                           directions=directions, partition_mode="joint").mean()
    (value * UPSTREAM).backward()
    return value.detach(), [leaf.grad for leaf in leaves] + [scale.grad]


def _largest_logit(path, columns):
    _, _, similarity = PATHS[path]
    rows = [c.double() for c in columns]
    if similarity == "cos_sim":
        rows = [torch.nn.functional.normalize(r, dim=1) for r in rows]
    return SCALE[similarity] * max((rows[0] @ r.T).abs().max().item() for r in rows)


def _errors(got, want):
    """(relative error of the loss, of the gradients: the worst column, relative to its largest entry)."""
    value, grads = got
    ref_value, ref_grads = want
    return (abs(value - ref_value).item() / abs(ref_value).item(),
            max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, ref_grads)))


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    if request.param == "recomputed":
        monkeypatch.setattr(sentence_transformers_columns, "KEEP_SOFTMAX_BYTES", 0)
    return request.param


def test_autocast(path):
    """Under CPU autocast (bf16 and fp16; fp32 and 16-bit embeddings; backward inside and after the
    block) the patched loss runs, computes as outside autocast (within fp32 rounding of the fp64 value
    of its inputs: autocast does not apply to it), and so gives the library's value under the same
    autocast within the 16-bit type's reach (the library's similarities are 16-bit there)."""
    columns, _ = global_batch([5], 2, torch.float64, seed=11)
    for autocast_dtype, same_dtype, inside in itertools.product((torch.bfloat16, torch.float16), (False, True),
                                                                (False, True)):
        inputs = [c.to(autocast_dtype if same_dtype else torch.float32) for c in columns]
        case = f"{path}, {autocast_dtype} autocast, {inputs[0].dtype} embeddings, backward {'in' if inside else 'after'}"
        library = _run(_loss(path), inputs, autocast_dtype, inside)
        fused = _patched(_run, _loss(path), inputs, autocast_dtype, inside)
        reference = _reference(path, inputs)
        reference = reference[0], reference[1][:-1]
        value_error, grad_error = _errors(fused, reference)
        # 16-bit embeddings get 16-bit gradients: one rounding of the fp32 result
        grad_rounding = torch.finfo(inputs[0].dtype).eps
        assert value_error < 1e-5 and grad_error < 1e-5 + grad_rounding, (case, value_error, grad_error)
        reach = torch.finfo(autocast_dtype).eps * _largest_logit(path, inputs)  # a logit's rounding in 16 bits
        library_value_error, library_grad_error = _errors(library, fused)
        assert library_value_error < 2 * reach and library_grad_error < 8 * reach, (
            case, library_value_error, library_grad_error)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_embeddings_are_as_accurate_as_the_library(path, dtype):
    """16-bit embeddings without autocast: the library's cos_sim and dot_score compute in fp32; the
    patched loss normalises and accumulates in fp32 too, so it is never further from the fp64 value
    of the same inputs (its gradients are rounded to 16 bits once, as the library's)."""
    columns = [c.to(dtype) for c in global_batch([8], 2, torch.float64, seed=12)[0]]
    library = _run(_loss(path), columns)
    fused = _patched(_run, _loss(path), columns)
    reference = _reference(path, columns)
    reference = reference[0], reference[1][:-1]
    (value_error, grad_error), (library_value_error, library_grad_error) = (
        _errors(fused, reference), _errors(library, reference))
    assert value_error <= 2 * library_value_error + 1e-6, (value_error, library_value_error)
    assert grad_error <= 2 * library_grad_error + 1e-6, (grad_error, library_grad_error)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_learnable_scale_gets_the_library_gradient(path, dtype):
    """`loss.scale = nn.Parameter(...)` (a learnable temperature; the library multiplies by it): the
    patched loss gives the library's loss and the gradients of the embeddings and of the scale."""
    columns = [c.to(dtype) for c in global_batch([6], 2, torch.float64, seed=13)[0]]
    results = []
    for patched in (False, True):
        scale = torch.nn.Parameter(torch.tensor(SCALE[PATHS[path][2]] * 0.9, dtype=dtype))
        run = _patched if patched else (lambda fn, *args: fn(*args))
        value, grads = run(_run, _loss(path, scale), columns)
        assert scale.grad is not None, "no gradient of the scale"
        results.append((value, grads + [scale.grad.double()]))
    library, fused = results
    reference = _reference(path, columns, scale=SCALE[PATHS[path][2]] * 0.9)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    for name, got in (("library", library), ("fused", fused)):
        value_error, grad_error = _errors(got, reference)
        assert value_error < tolerance and grad_error < tolerance, (name, value_error, grad_error)
