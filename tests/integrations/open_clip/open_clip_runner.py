"""Runs open_clip_train under torchrun for tests/integrations/open_clip/test_open_clip_train.py,
recording every loss call.

    torchrun ... tests/integrations/open_clip/open_clip_runner.py RECORD_DIR stock|clipshard [open_clip_train's args]

stock:     open_clip_train.main.main(args), with only torch's refusal of CPU device_ids lifted (its DDP
           call passes device_ids=[cpu]); clipshard is never imported.
clipshard: `python -m clipshard.open_clip_train args`, run with runpy as python -m runs it.
$OPEN_CLIP_TEST_MODEL_CONFIGS: the folder of the test's model config, registered with open_clip.
$OPEN_CLIP_TEST_COMPILE_BACKEND (optional): the backend of open_clip_train's --torchcompile (its
torch.compile(model) call takes none; inductor's code generation is slow on a small CPU).
Each rank writes RECORD_DIR/rank<r>.jsonl: the class create_loss built, then one line per forward
with the loss values at full precision, then whether clipshard was imported.
"""
import functools
import json
import os
import runpy
import sys

import open_clip
import torch


def _recording(create_loss, path):
    def create(args):
        loss = create_loss(args)
        cls = type(loss)
        with open(path, "a") as f:
            f.write(json.dumps({"loss_class": f"{cls.__module__}.{cls.__qualname__}"}) + "\n")

        def record(module, inputs, output):
            with open(path, "a") as f:
                f.write(json.dumps({k: v.item() for k, v in output.items()}) + "\n")
        loss.register_forward_hook(record)
        return loss
    return create


class _CpuDDP(torch.nn.parallel.DistributedDataParallel):
    def __init__(self, module, device_ids=None, *args, **kwargs):
        super().__init__(module, None if module_on_cpu(module) else device_ids, *args, **kwargs)


def module_on_cpu(module):
    return all(p.device.type == "cpu" for p in module.parameters())


def main():
    record_dir, which, *args = sys.argv[1:]
    path = os.path.join(record_dir, f"rank{os.environ.get('RANK', '0')}.jsonl")
    open_clip.create_loss = _recording(open_clip.create_loss, path)  # before open_clip_train imports it
    open_clip.add_model_config(os.environ["OPEN_CLIP_TEST_MODEL_CONFIGS"])  # the test's tiny_clip
    if os.environ.get("OPEN_CLIP_TEST_COMPILE_BACKEND"):
        torch.compile = functools.partial(torch.compile, backend=os.environ["OPEN_CLIP_TEST_COMPILE_BACKEND"])
    if which == "stock":
        torch.nn.parallel.DistributedDataParallel = _CpuDDP
        from open_clip_train.main import main as train_main
        result = train_main(args)
    else:
        sys.argv = ["clipshard.open_clip_train", *args]
        try:
            runpy.run_module("clipshard.open_clip_train", run_name="__main__", alter_sys=True)
            result = None
        except SystemExit as e:
            result = e.code
    with open(path, "a") as f:
        f.write(json.dumps({"clipshard_imported": "clipshard" in sys.modules}) + "\n")
    sys.exit(0 if result is None else result)


if __name__ == "__main__":
    main()
