"""examples/train_clip.py: flag validation, data and model pieces in-process, and real 2-rank gloo
runs through torchrun (a smoke run, and interrupted + resumed == uninterrupted, bit for bit)."""
import json
import os
import subprocess
import sys

import pytest
import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import train_clip  # noqa: E402
from clip_digits.data import global_batch_indices, load_digits_data, rank_batch  # noqa: E402
from clip_digits.measure import peak_loss_memory  # noqa: E402
from clip_digits.model import TextEncoder  # noqa: E402

TINY = ["--steps", "6", "--batch-size", "64", "--warmup", "2", "--eval-every", "3", "--checkpoint-every", "2",
        "--image-width", "8", "--text-width", "16", "--text-layers", "2", "--text-heads", "2", "--embed-dim", "16"]


# ---- flags ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "255"], "--batch-size (255) must be divisible by the number of ranks (2)"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--text-precision", "fp8"], "argument --text-precision: invalid choice: 'fp8'"),
    (["--loss", "naive"], "argument --loss: invalid choice: 'naive'"),
    (["--lr", "0"], "--lr must be positive, got 0.0"),
    (["--resume"], "--resume needs --out"),
    (["--steps", "10", "--stop-after", "10"], "--stop-after must be in [1, --steps), got 10"),
    (["--text-width", "30", "--text-heads", "4"], "--text-width (30) must be divisible by --text-heads (4)"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs --device cuda"),
])
def test_bad_flags_exit_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_clip.parse_args(argv, world_size=2)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_default_flags_are_valid_for_two_ranks():
    args = train_clip.parse_args([], world_size=2)
    assert (args.loss, args.text_precision, args.half_dtype, args.checkpointing) == ("clipshard", "sr16", "bf16", True)
    assert args.batch_size % 2 == 0


# ---- data and model ---------------------------------------------------------------------------

def test_held_out_images_are_never_trained_on_and_ranks_split_each_batch():
    data = load_digits_data()
    assert len(data.train_labels) + len(data.test_labels) == 1797
    train_rows = {tuple(x.flatten().tolist()) for x in data.train_images}
    assert not any(tuple(x.flatten().tolist()) in train_rows for x in data.test_images)
    assert sorted(data.test_labels.unique().tolist()) == list(range(10))
    batch = global_batch_indices(len(data.train_labels), 64, seed=3, step=5)
    assert len(set(batch.tolist())) == 64
    shards = [rank_batch(data, 64, 3, 5, rank, 4) for rank in range(4)]
    assert torch.equal(torch.cat([labels for _, _, labels in shards]), data.train_labels[batch])
    for images, token_ids, labels in shards:  # every caption names its image's digit
        for ids, label in zip(token_ids, labels):
            assert any(torch.equal(ids, c) for c in data.caption_ids[label])


def test_gradient_checkpointing_gives_the_same_gradients():
    data = load_digits_data()
    torch.manual_seed(0)
    encoder = TextEncoder(len(data.tokenizer), data.tokenizer.max_length, 16, 2, 2, 8, checkpointing=True)
    tokens = data.caption_ids[:, :3].reshape(-1, data.tokenizer.max_length)
    grads = []
    for checkpointing in (True, False):
        encoder.checkpointing = checkpointing
        encoder.zero_grad()
        (encoder(tokens) ** 2).sum().backward()
        grads.append([p.grad.clone() for p in encoder.parameters()])
    for with_ckpt, without in zip(*grads):
        torch.testing.assert_close(with_ckpt, without, rtol=0, atol=1e-6)


def test_peak_loss_memory_sees_a_materialised_similarity_matrix():
    def materialising_loss(image, text, scale):  # keeps the 512 x 512 fp32 logits (1 MiB) alive
        logits = scale * image @ text.T
        return logits.logsumexp(dim=1).mean() - logits.diagonal().mean()

    image, text = torch.randn(512, 8), torch.randn(512, 8)
    peak = peak_loss_memory(materialising_loss, image, text, torch.tensor(2.0), repeats=1)
    assert 512 * 512 * 4 <= peak < 8 * 512 * 512 * 4


# ---- real 2-rank runs -------------------------------------------------------------------------

def _torchrun(out_dir, *extra):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(EXAMPLES, "train_clip.py"), "--out", str(out_dir), *TINY, *extra]
    repo = os.path.dirname(EXAMPLES)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    for attempt in range(2):
        done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
        # A port picked by torchrun can be taken by another job before the ranks bind it: retry once.
        if done.returncode == 0 or "address already in use" not in done.stderr.lower():
            break
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("whole")
    return out_dir, _torchrun(out_dir)


def test_smoke_run_writes_sane_metrics_and_a_plot(uninterrupted):
    out_dir, stdout = uninterrupted
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert 0.0 <= metrics["zero_shot_accuracy"] <= 1.0
    assert metrics["peak_loss_memory_bytes"] > 0
    assert metrics["wall_seconds"] > metrics["train_seconds"] > 0
    assert metrics["world_size"] == 2 and metrics["backend"] == "gloo"
    assert metrics["config"]["text_precision"] == "sr16"
    # bf16 weights + bf16 moments = 6 bytes (plus a 4-byte step counter per tensor); fp32: 12 bytes.
    assert 6.0 <= metrics["optimizer_bytes_per_param_text"] < 6.5
    assert 12.0 <= metrics["optimizer_bytes_per_param_image"] < 12.5
    assert 6.0 < metrics["optimizer_bytes_per_param"] < 12.5
    history = metrics["history"]
    assert history["loss_steps"] == list(range(1, 7)) and all(0 < x < 20 for x in history["loss"])
    assert history["eval_steps"] == [0, 3, 6]
    assert (out_dir / "training.png").stat().st_size > 1000
    assert "zero-shot accuracy" in stdout
    # Stochastic rounding with the same bits on every rank keeps the replicas identical.
    states = [torch.load(out_dir / "checkpoint" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert any(t.dtype == torch.bfloat16 for t in states[0]["model"].values())
    _assert_bitwise_equal(states[0]["model"], states[1]["model"], "model")
    _assert_bitwise_equal(states[0]["optimizers"], states[1]["optimizers"], "optimizers")


def test_interrupted_and_resumed_run_matches_the_uninterrupted_one_bitwise(uninterrupted, tmp_path):
    whole_dir, _ = uninterrupted
    stdout = _torchrun(tmp_path, "--stop-after", "3")
    assert "stopped after step 3 of 6" in stdout
    assert not (tmp_path / "metrics.json").exists()
    _torchrun(tmp_path, "--resume")
    for rank in range(2):
        whole = torch.load(whole_dir / "checkpoint" / f"rank{rank}.pt", weights_only=False)
        resumed = torch.load(tmp_path / "checkpoint" / f"rank{rank}.pt", weights_only=False)
        assert whole["step"] == resumed["step"] == 6
        _assert_bitwise_equal(whole["model"], resumed["model"], "model")
        _assert_bitwise_equal(whole["optimizers"], resumed["optimizers"], "optimizers")
        _assert_bitwise_equal(whole["rng"]["generators"], resumed["rng"]["generators"], "rng")
        assert torch.equal(whole["rng"]["torch"], resumed["rng"]["torch"])
        assert whole["history"] == resumed["history"]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 3


def _assert_bitwise_equal(a, b, where):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise_equal(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        as_bytes = lambda t: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(as_bytes(a), as_bytes(b)), where
    else:
        assert a == b, where
