"""A few Trainer steps of a tiny CLIPModel, for tests/integrations/transformers/test_transformers_trainer.py.

    torchrun --nproc-per-node 2 tests/integrations/transformers/hf_trainer_runner.py OUT.json RUN [RUN ...]
    (or in one process: train(run, global_batch) from the test itself)

RUN is one of
  own        the model's own return_loss (no patch)
  clipshard  apply_to_transformers()
  recipe     apply_to_transformers(logits=False), bf16 mixed precision, gradient checkpointing of the
             towers and clipshard.optim.AdamW passed to Trainer as its optimizer
Rank 0 writes {RUN: [the loss Trainer logged at each step]} to OUT.json. Same seed, same data in the
same order (sequential sampling) on any number of ranks; the model has no dropout.
"""
import dataclasses
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))  # the repo root
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import clipshard  # noqa: E402
from tests.integrations.transformers.hf_tiny_models import rows, tiny_inputs, tiny_model  # noqa: E402

STEPS, GLOBAL_BATCH, LR = 4, 8, 5e-3


class Pairs(torch.utils.data.Dataset):
    def __init__(self, inputs):
        self.inputs = inputs

    def __len__(self):
        return len(self.inputs["input_ids"])

    def __getitem__(self, i):
        return rows(self.inputs, i, i + 1)


def collate(items):
    batch = {k: torch.cat([item[k] for item in items]) for k in items[0]}
    return {**batch, "return_loss": True}


def _sequential_and_checkpointing(transformers, checkpointing):
    """TrainingArguments for sequential sampling and checkpointing: transformers 5.x's names, or 4.x's
    (which has no sampling option: _sequential_trainer covers it)."""
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    sampling = {"train_sampling_strategy": "sequential"} if "train_sampling_strategy" in fields else {}
    return {**sampling, name: checkpointing, f"{name}_kwargs": {"use_reentrant": False} if checkpointing else None}


def _sequential_trainer(transformers):
    """Trainer, with its training data read in order where TrainingArguments cannot say so (4.x)."""
    if "train_sampling_strategy" in {f.name for f in dataclasses.fields(transformers.TrainingArguments)}:
        return transformers.Trainer

    class SequentialTrainer(transformers.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)
    return SequentialTrainer


def train(run, world_size=1):
    """The per-step losses Trainer logs for `run` (see the module docstring)."""
    import transformers

    patch = None
    if run in ("clipshard", "recipe"):
        patch = clipshard.apply_to_transformers(logits=run == "clipshard")
    try:
        model = tiny_model("CLIPModel").train()
        data = Pairs(tiny_inputs("CLIPModel", STEPS * GLOBAL_BATCH, seed=7))
        recipe = run == "recipe"
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world_size, max_steps=STEPS,
                learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1, seed=0,
                use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
                ddp_find_unused_parameters=False, dataloader_num_workers=0, bf16=recipe,
                **_sequential_and_checkpointing(transformers, recipe))
            optimizers = (clipshard.optim.AdamW(model.parameters(), lr=LR), None) if recipe else (None, None)
            trainer = _sequential_trainer(transformers)(model=model, args=args, train_dataset=data,
                                                        data_collator=collate, optimizers=optimizers)
            trainer.train()
        assert recipe == (type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                                else trainer.optimizer) is clipshard.optim.AdamW)
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    finally:
        if patch is not None:
            patch.undo()


def main(out_path, runs):
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    losses = {run: train(run, world_size) for run in runs}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
