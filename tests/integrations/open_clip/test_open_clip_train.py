"""open_clip_train itself on 2 gloo ranks (torchrun, CPU): stock open_clip against
`python -m clipshard.open_clip_train`, on a tiny model config and a small CSV of drawn images.

fp32: the same per-step losses (1e-5 relative) from clipshard's ClipLoss; 16-bit text tower +
clipshard AdamW: the loss falls, 6 bytes per text parameter, and open_clip_train's own checkpoint
resumes. tests/integrations/open_clip/open_clip_runner.py records each loss call at full precision."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("open_clip", reason="open_clip is not installed: pip install '.[open_clip]'")
pytest.importorskip("open_clip_train.main", reason="open_clip_train or its data packages (pandas, webdataset, "
                                                   "braceexpand) are missing: pip install '.[open_clip]'")
from PIL import Image, ImageDraw  # noqa: E402  (a dependency of open_clip's transforms)

from clipshard.integrations.open_clip_train import (  # noqa: E402
    main as clipshard_train_main, numpy_scalars_loadable, parse_clipshard_args)

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(TESTS, "..", "..", ".."))
SAMPLES, BATCH, RANKS = 64, 8, 2
STEPS_PER_EPOCH = SAMPLES // (BATCH * RANKS)
TEXT_TOWER = ("transformer.", "token_embedding.", "positional_embedding", "ln_final.", "text_projection")
TINY_CLIP = {"embed_dim": 32,
             "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
             "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
TINY_TEACHER = {**TINY_CLIP, "embed_dim": 48}  # a wider embedding than the student's
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220), "yellow": (230, 200, 40)}


def write_data(root):
    """A model config directory (models tiny_clip and tiny_teacher, registered in each rank with
    open_clip.add_model_config: the `local-dir:` schema is newer than open_clip 2.26) and a tab-separated CSV of 64 drawn shapes
    with captions such as 'a red circle'."""
    (root / "model").mkdir()
    (root / "model" / "tiny_clip.json").write_text(json.dumps(TINY_CLIP))
    (root / "model" / "tiny_teacher.json").write_text(json.dumps(TINY_TEACHER))
    rng = random.Random(0)
    rows = ["filepath\ttitle"]
    for i in range(SAMPLES):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(["circle", "square"])
        image = Image.new("RGB", (32, 32), (255, 255, 255))
        x, y = rng.randint(2, 14), rng.randint(2, 14)
        draw = ImageDraw.Draw(image)
        (draw.ellipse if shape == "circle" else draw.rectangle)([x, y, x + 16, y + 16], fill=COLOURS[colour])
        image.save(root / f"{i}.png")
        rows.append(f"{root / f'{i}.png'}\ta {colour} {shape}")
    (root / "train.csv").write_text("\n".join(rows) + "\n")
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("open_clip_data"))


def test_clipshard_options_are_split_from_open_clip_train_arguments():
    options, rest = parse_clipshard_args(["--model", "m", "--clipshard-text-dtype", "bfloat16", "--lr", "1",
                                          "--clipshard-adamw"])
    assert (options.clipshard_text_dtype, options.clipshard_adamw, rest) == ("bfloat16", True, ["--model", "m", "--lr", "1"])
    assert parse_clipshard_args(["--clipshard-adam"])[1] == ["--clipshard-adam"]  # no abbreviations: open_clip_train rejects it


def test_checkpoints_with_numpy_learning_rates_load_for_resume(tmp_path):
    """open_clip_train 2.x writes each param group's lr as a numpy float64; its --resume loads with
    torch's default weights_only=True, which the entry point lets load numpy scalars."""
    import numpy
    path = tmp_path / "epoch_1.pt"
    torch.save({"optimizer": {"param_groups": [{"lr": numpy.float64(0.25)}]}, "w": torch.arange(3.0)}, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(path)
    with numpy_scalars_loadable():
        loaded = torch.load(path)
    assert loaded["optimizer"]["param_groups"][0]["lr"] == 0.25 and loaded["w"].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(Exception, match="Weights only load failed"):  # only inside the entry point
        torch.load(path)


def _train_option(name):
    """Whether this open_clip_train's parser has --name (--device and --opt are newer than 2.26)."""
    from open_clip_train.params import parse_args
    return hasattr(parse_args(["--train-data", "x.csv"]), name)


def test_clipshard_adamw_refuses_another_optimizer():
    if not _train_option("opt"):
        pytest.skip("this open_clip_train has no --opt: it always builds AdamW, there is nothing to refuse")
    with pytest.raises(SystemExit, match="--clipshard-adamw replaces open_clip_train's --opt adamw, got --opt timm/lamb"):
        clipshard_train_main(["--clipshard-adamw", "--opt", "timm/lamb", "--train-data", "x.csv"])


@pytest.mark.parametrize("value", ["0", "-2"])
def test_accum_freq_below_one_is_refused_naming_the_option(value):
    with pytest.raises(SystemExit, match=f"--accum-freq must be >= 1 .*got --accum-freq {value}$"):
        clipshard_train_main(["--accum-freq", value, "--train-data", "x.csv"])


def _train(data, workdir, which, name, *extra, env=None):
    """Runs open_clip_train through the runner; returns each rank's records. The working directory
    holds ./logs (open_clip_train's --logs cannot be passed through torchrun, which takes it for
    its own --logs-specs)."""
    record_dir = workdir / f"records-{name}"
    record_dir.mkdir()
    args = ["--model", "tiny_clip", "--train-data", str(data / "train.csv"),
            "--dataset-type", "csv", "--batch-size", str(BATCH), "--workers", "0",
            "--dist-backend", "gloo", *(["--device", "cpu"] if _train_option("device") else []),  # 2.26: cpu by itself
            "--precision", "fp32", "--lr", "1e-3", "--warmup", "2", "--seed", "0", "--log-every-n-steps", "1",
            "--name", name, *extra]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
               os.path.join(TESTS, "open_clip_runner.py"), str(record_dir), which, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPEN_CLIP_TEST_MODEL_CONFIGS": str(data / "model"),
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), **(env or {})}
    for attempt in range(2):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=workdir)
        # A port picked by torchrun can be taken by another job before the ranks bind it: retry once.
        if done.returncode == 0 or "address already in use" not in done.stderr.lower():
            break
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ranks = []
    for rank in range(RANKS):
        lines = [json.loads(line) for line in (record_dir / f"rank{rank}.jsonl").read_text().splitlines()]
        ranks.append({"loss_class": lines[0]["loss_class"], "clipshard_imported": lines[-1]["clipshard_imported"],
                      "losses": [line["contrastive_loss"] for line in lines[1:-1]],
                      "distill_losses": [line.get("distill_loss") for line in lines[1:-1]]})
    return ranks, done.stdout + done.stderr


def _max_relative_difference(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def stock_default(data, tmp_path_factory):
    """Stock open_clip_train's per-rank records, one epoch with the default loss options."""
    return _train(data, tmp_path_factory.mktemp("stock_default"), "stock", "stock", "--epochs", "1")[0]


@pytest.mark.parametrize("flags", [[], ["--local-loss", "--gather-with-grad"]], ids=["default", "local+gather"])
def test_fp32_losses_match_stock_open_clip_train(data, tmp_path, flags, stock_default):
    stock = stock_default if not flags else _train(data, tmp_path, "stock", "stock", "--epochs", "1", *flags)[0]
    ours, log = _train(data, tmp_path, "clipshard", "clipshard", "--epochs", "1", *flags)
    for rank in range(RANKS):
        assert stock[rank]["loss_class"] == "open_clip.loss.ClipLoss" and not stock[rank]["clipshard_imported"]
        assert ours[rank]["loss_class"] == "clipshard.losses.clip.ClipLoss"
        assert len(stock[rank]["losses"]) == len(ours[rank]["losses"]) == STEPS_PER_EPOCH
        assert len(set(stock[rank]["losses"])) == STEPS_PER_EPOCH  # training moves the loss each step
        difference = _max_relative_difference(ours[rank]["losses"], stock[rank]["losses"])
        print(f"{flags or 'default'} rank {rank}: max relative loss difference {difference:.2e}")
        assert difference <= 1e-5, (ours[rank]["losses"], stock[rank]["losses"])
    assert "clipshard: create_loss built clipshard.losses.clip.ClipLoss" in log
    assert "left as open_clip's: none" in log


def test_torchcompile_losses_match_stock_open_clip_train(data, tmp_path, stock_default):
    """open_clip_train's --torchcompile (torch.compile(model), here with backend aot_eager: dynamo's
    graphs and their traced backward, without inductor's slow code generation) with clipshard's loss:
    stock open_clip_train's eager losses at every step (fp32, 1e-5)."""
    stock = stock_default
    ours, log = _train(data, tmp_path, "clipshard", "clipshard", "--epochs", "1", "--torchcompile",
                       env={"OPEN_CLIP_TEST_COMPILE_BACKEND": "aot_eager"})
    assert "Compiling model" in log
    for rank in range(RANKS):
        assert ours[rank]["loss_class"] == "clipshard.losses.clip.ClipLoss"
        assert len(ours[rank]["losses"]) == len(stock[rank]["losses"]) == STEPS_PER_EPOCH
        difference = _max_relative_difference(ours[rank]["losses"], stock[rank]["losses"])
        assert difference <= 1e-5, (ours[rank]["losses"], stock[rank]["losses"])


def write_teacher(root):
    """A small random teacher (config tiny_teacher) saved to a file, the --distill-pretrained that
    open_clip_train needs besides --distill-model to distill."""
    import open_clip
    torch.manual_seed(1)
    checkpoint = root / "teacher.pt"
    torch.save(open_clip.CLIP(**TINY_TEACHER).state_dict(), checkpoint)
    return checkpoint


def test_distill_losses_match_stock_open_clip_train(data, tmp_path):
    """--distill-model with a local teacher checkpoint: clipshard's DistillClipLoss gives stock
    open_clip_train's contrastive and distillation losses at every step (fp32, 1e-5)."""
    flags = ["--epochs", "1", "--distill-model", "tiny_teacher", "--distill-pretrained", str(write_teacher(tmp_path))]
    stock, _ = _train(data, tmp_path, "stock", "stock", *flags)
    ours, log = _train(data, tmp_path, "clipshard", "clipshard", *flags)
    for rank in range(RANKS):
        assert stock[rank]["loss_class"] == "open_clip.loss.DistillClipLoss"
        assert ours[rank]["loss_class"] == "clipshard.losses.distill.DistillClipLoss"
        for key in ("losses", "distill_losses"):
            assert len(stock[rank][key]) == len(ours[rank][key]) == STEPS_PER_EPOCH
            assert len(set(stock[rank][key])) == STEPS_PER_EPOCH
            difference = _max_relative_difference(ours[rank][key], stock[rank][key])
            print(f"distill rank {rank} {key}: max relative difference {difference:.2e}")
            assert difference <= 1e-5, (ours[rank][key], stock[rank][key])
    assert "clipshard: create_loss built clipshard.losses.distill.DistillClipLoss" in log


@pytest.fixture(scope="module")
def half_text_runs(data, tmp_path_factory):
    """Two epochs with a bf16 text tower and clipshard AdamW, then a third resumed from the
    checkpoint open_clip_train wrote after the second."""
    workdir = tmp_path_factory.mktemp("half_text")
    recipe = ["--clipshard-text-dtype", "bfloat16", "--clipshard-adamw"]
    first, log = _train(data, workdir, "clipshard", "first", "--epochs", "2", *recipe)
    checkpoint = workdir / "logs" / "first" / "checkpoints" / "epoch_2.pt"
    resumed, _ = _train(data, workdir, "clipshard", "resumed", "--epochs", "3", "--resume", str(checkpoint), *recipe)
    return first, log, checkpoint, resumed, workdir / "logs" / "resumed" / "checkpoints" / "epoch_3.pt"


def _load(path):
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    model = {k.removeprefix("module."): v for k, v in checkpoint["state_dict"].items()}
    return model, checkpoint["optimizer"]


def test_half_text_tower_with_clipshard_adamw_trains(half_text_runs):
    first, log, _, _, _ = half_text_runs
    assert "clipshard: text tower (1595360 parameters) stored in torch.bfloat16" in log
    assert "clipshard.optim.AdamW in place of torch.optim.AdamW" in log
    for rank in range(RANKS):
        losses = first[rank]["losses"]
        assert first[rank]["loss_class"] == "clipshard.losses.clip.ClipLoss"
        assert len(losses) == 2 * STEPS_PER_EPOCH
        print(f"rank {rank}: losses {[round(x, 4) for x in losses]}")
        assert max(losses[-STEPS_PER_EPOCH:]) < 0.8 * losses[0]


def test_half_text_tower_costs_6_bytes_per_parameter(half_text_runs):
    _, _, checkpoint, _, _ = half_text_runs
    model, optimizer = _load(checkpoint)
    text = {k: v for k, v in model.items() if k.startswith(TEXT_TOWER)}
    rest = {k: v for k, v in model.items() if k not in text}
    assert {v.dtype for v in text.values()} == {torch.bfloat16}
    assert {v.dtype for v in rest.values()} == {torch.float32}
    assert all(g["stochastic_rounding"] for g in optimizer["param_groups"])  # clipshard's AdamW saved these
    states = [s for s in optimizer["state"].values()]
    assert len(states) == len(model)  # every parameter took steps
    moments = {dtype: sorted(t.numel() for s in states for k, t in s.items() if k != "step" and t.dtype == dtype)
               for dtype in (torch.bfloat16, torch.float32)}
    # each text parameter has two bf16 moments of its size, each other parameter two fp32 ones
    assert moments[torch.bfloat16] == sorted(2 * [v.numel() for v in text.values()])
    assert moments[torch.float32] == sorted(2 * [v.numel() for v in rest.values()])
    text_numel = sum(v.numel() for v in text.values())
    text_bytes = sum(v.numel() * v.element_size() for v in text.values()) + 2 * sum(moments[torch.bfloat16])
    print(f"text tower: {text_numel} parameters, {text_bytes / text_numel:.2f} bytes each")
    assert text_bytes / text_numel == 6.0


def test_half_text_tower_resumes_from_open_clip_train_checkpoint(half_text_runs):
    first, _, checkpoint, resumed, last_checkpoint = half_text_runs
    saved, _ = _load(checkpoint)
    model, optimizer = _load(last_checkpoint)
    assert {int(s["step"]) for s in optimizer["state"].values()} == {3 * STEPS_PER_EPOCH}
    assert all(model[k].dtype == v.dtype for k, v in saved.items())
    assert not torch.equal(model["token_embedding.weight"], saved["token_embedding.weight"])  # it trained on
    for rank in range(RANKS):
        assert len(resumed[rank]["losses"]) == STEPS_PER_EPOCH  # epoch 3 only
        # it starts where the first run ended, far below a fresh model's loss
        assert resumed[rank]["losses"][0] < 0.75 * first[rank]["losses"][0]
