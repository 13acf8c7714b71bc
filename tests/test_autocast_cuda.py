"""Mixed precision on a GPU as PyTorch documents it (skipped without one; benchmarks/gpu_check.sh runs
it with every `cuda` test): the forward under torch.autocast("cuda", bf16 / fp16), GradScaler's
scaled backward after the block and its unscale_. ClipLoss, SigLipLoss and DistillClipLoss (every
algorithm), the sentence-transformers patch (the kept and the recomputed softmax, the general path
of the other directions) and GradCache: each computes what it computes outside autocast (autocast
does not apply inside clipshard's ops) and what open_clip's loss / the library / the plain step
give under the same autocast within the 16-bit type's reach."""
import contextlib

import pytest
import torch

import clipshard
from tests.integrations.grad_cache.grad_cache_models import TinyClip, batch, call_loss, concatenated, grads, \
    max_relative_difference

pytestmark = pytest.mark.cuda
DTYPES = [torch.bfloat16, torch.float16]
SCALE = 10.0


def _scaled_step(leaves, autocast_dtype, forward):
    """forward() under CUDA autocast (None: without), GradScaler's backward after the block, unscaled
    gradients of `leaves`; returns (loss, gradients) in fp64 on the CPU."""
    scaler = torch.amp.GradScaler("cuda", enabled=autocast_dtype is not None)
    optimizer = torch.optim.SGD(leaves, lr=0.0)  # only for unscale_
    context = (torch.autocast("cuda", dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
    with context:
        value = forward()
    scaler.scale(value).backward()
    scaler.unscale_(optimizer)
    return value.detach().double().cpu(), [leaf.grad.double().cpu() for leaf in leaves]


def _relative(got, want):
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip([got[0]] + got[1], [want[0]] + want[1]))


def _features(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(37, 64, generator=g, dtype=torch.float64), dim=1)
    text = torch.nn.functional.normalize(image + 0.5 * torch.randn(37, 64, generator=g, dtype=torch.float64), dim=1)
    return [t.to(device="cuda", dtype=dtype) for t in (image, text)]


def _loss_step(loss, autocast_dtype, feature_dtype):
    """GradScaler needs fp32 leaves: 16-bit features are cast from them, as a model's 16-bit outputs."""
    leaves = [f.requires_grad_() for f in _features(1)]
    scale = torch.tensor(SCALE, device="cuda", requires_grad=True)

    def forward():
        image, text = (leaf.to(feature_dtype) for leaf in leaves)
        name = type(loss).__name__
        if name == "SigLipLoss":
            return loss(image, text, scale, torch.tensor(-5.0, device="cuda"))
        if name == "DistillClipLoss":
            return sum(loss(image, text, scale, *_features(2, feature_dtype), torch.tensor(12.0, device="cuda")))
        return loss(image, text, scale)

    return _scaled_step(leaves + [scale], autocast_dtype, forward)


@pytest.mark.parametrize("autocast_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,algorithm", [("ClipLoss", "chunked"), ("ClipLoss", "fused"), ("ClipLoss", "torch"),
                                            ("SigLipLoss", "chunked"), ("SigLipLoss", "torch"),
                                            ("DistillClipLoss", "auto"), ("DistillClipLoss", "torch")])
def test_losses(name, algorithm, autocast_dtype):
    open_clip_loss = pytest.importorskip("open_clip.loss")
    for feature_dtype in (torch.float32, autocast_dtype):
        ours = _loss_step(getattr(clipshard, name)(algorithm=algorithm), autocast_dtype, feature_dtype)
        outside = _loss_step(getattr(clipshard, name)(algorithm=algorithm), None, feature_dtype)
        assert _relative(ours, outside) < 1e-6, (name, algorithm, feature_dtype, "differs outside autocast")
        own = _loss_step(getattr(open_clip_loss, name)(), autocast_dtype, feature_dtype)
        reach = torch.finfo(autocast_dtype).eps * SCALE
        assert _relative(ours, own) < 8 * reach, (name, algorithm, feature_dtype, _relative(ours, own))


@pytest.mark.parametrize("autocast_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["kept", "recomputed", "directions"])
def test_sentence_transformers(path, autocast_dtype, monkeypatch):
    pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer import losses

    from clipshard.integrations import sentence_transformers_columns

    if path == "recomputed":
        monkeypatch.setattr(sentence_transformers_columns, "KEEP_SOFTMAX_BYTES", 0)
    directions = ("query_to_doc", "doc_to_query", "query_to_query") if path == "directions" else ("query_to_doc",)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(29, 48, generator=g, dtype=torch.float64)
    columns = [(base + 0.7 * torch.randn(29, 48, generator=g, dtype=torch.float64)).float().cuda() for _ in range(3)]

    def step(patched, dtype):
        leaves = [c.clone().requires_grad_() for c in columns]
        patch = clipshard.apply_to_sentence_transformers() if patched else None
        try:
            loss = losses.MultipleNegativesRankingLoss(torch.nn.Identity(), directions=directions)
            return _scaled_step(leaves, dtype, lambda: loss.compute_loss_from_embeddings(leaves, None))
        finally:
            if patch is not None:
                patch.undo()

    ours, outside, library = step(True, autocast_dtype), step(True, None), step(False, autocast_dtype)
    assert _relative(ours, outside) < 1e-6, path
    reach = torch.finfo(autocast_dtype).eps * 20.0  # the library's scale
    assert _relative(ours, library) < 8 * reach, (path, _relative(ours, library))


@pytest.mark.parametrize("autocast_dtype", DTYPES, ids=str)
def test_grad_cache(autocast_dtype):
    images, tokens = (t.cuda() for t in batch(11, 4, torch.float32))
    results = []
    for cached in (True, False):
        torch.manual_seed(3)
        model = TinyClip(dtype=torch.float32, with_bias=False).cuda()
        scaler = torch.amp.GradScaler("cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        with torch.autocast("cuda", dtype=autocast_dtype):
            if cached:
                loss = clipshard.GradCache(model, clipshard.ClipLoss(), 4)(images, tokens)
            else:
                outputs = [model(i, t) for i, t in zip(images.split(4), tokens.split(4))]
                loss = call_loss(clipshard.ClipLoss(), concatenated(outputs))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        results.append(grads(model))
    assert max_relative_difference(*results) <= 4 * torch.finfo(autocast_dtype).eps
