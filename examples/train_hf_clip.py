"""Train a small Hugging Face CLIPModel on scikit-learn's handwritten digits with Trainer, with and
without clipshard's global-batch loss, and compare zero-shot accuracy.

    torchrun --standalone --nproc_per_node 2 examples/train_hf_clip.py
    accelerate launch --multi_gpu --num_processes 2 examples/train_hf_clip.py   (CPU ranks too)

The model is built from a CLIPConfig (random initialisation: nothing is downloaded): a ViT over the
8x8 digits in 2x2 patches and a text transformer over the captions' words (examples/clip_digits/data.py,
the data of examples/train_clip.py). It is trained twice with transformers' Trainer, on the same data
in the same order from the same initial weights: with the model's own return_loss (each rank
contrasts its local batch only) and after clipshard.apply_to_transformers() (each rank's pairs
against the global batch). Rank 0 prints the held-out zero-shot accuracy of both
(the nearest of the prompts "a handwritten zero" ... "a handwritten nine"). docs/transformers.md.
"""
import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a hub

import clipshard  # noqa: E402
from clip_digits.data import NUMBER_WORDS, load_digits_data, global_batch_indices  # noqa: E402

RUNS = {"own": "the model's own loss (local batch per rank)", "clipshard": "clipshard's global-batch loss"}


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="optimizer steps of each run")
    p.add_argument("--batch-size", type=int, default=128, help="global batch size (all ranks together)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which losses to train with")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (Trainer's bf16=True)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute the towers' activations")
    p.add_argument("--clipshard-adamw", action="store_true",
                   help="clipshard.optim.AdamW as Trainer's optimizer (optimizers=(AdamW, None))")
    p.add_argument("--no-logits", action="store_true",
                   help="apply_to_transformers(logits=False): training forwards skip the M x M logits")
    return p


class DigitPairs(torch.utils.data.Dataset):
    """The pairs of every global batch, in training order: global batch s is items s*B .. (s+1)*B-1,
    which Trainer's sequential sampling hands out as B / world_size consecutive items per rank."""

    def __init__(self, data, eos, steps, batch_size, seed):
        indices = torch.cat([global_batch_indices(len(data.train_labels), batch_size, seed, s) for s in range(steps)])
        generator = torch.Generator().manual_seed(seed)
        which = torch.randint(data.caption_ids.shape[1], (len(indices),), generator=generator)
        self.images = data.train_images[indices]
        self.ids = with_eos(data.caption_ids[data.train_labels[indices], which], eos)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], self.ids[i]


def with_eos(ids, eos):
    """Token ids with an end-of-text token after the last word (where CLIP's text tower pools)."""
    out = torch.cat([ids, torch.zeros_like(ids[:, :1])], dim=1)
    out[torch.arange(len(ids)), (ids != 0).sum(1)] = eos
    return out


def collate(items):
    images, ids = map(torch.stack, zip(*items))
    return {"pixel_values": images, "input_ids": ids, "attention_mask": (ids != 0).long(), "return_loss": True}


def build_model(vocab_size, tokens, seed):
    import transformers

    torch.manual_seed(seed)
    tower = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = transformers.CLIPConfig(
        text_config=dict(tower, vocab_size=vocab_size, max_position_embeddings=tokens, pad_token_id=0,
                         bos_token_id=1, eos_token_id=vocab_size - 1),
        vision_config=dict(tower, image_size=8, patch_size=2, num_channels=1),
        projection_dim=64)
    return transformers.CLIPModel(config)


@torch.no_grad()
def zero_shot_accuracy(model, data, eos):
    model.eval()
    image = model.get_image_features(pixel_values=data.test_images).pooler_output
    prompts = with_eos(data.prompt_ids, eos)
    text = model.get_text_features(input_ids=prompts, attention_mask=(prompts != 0).long()).pooler_output
    image, text = (torch.nn.functional.normalize(x.float(), dim=-1) for x in (image, text))
    return ((image @ text.T).argmax(1) == data.test_labels).float().mean().item()


def train(run, args, data, world_size):
    import transformers

    patch = clipshard.apply_to_transformers(logits=not args.no_logits) if run == "clipshard" else None
    try:
        eos = len(data.tokenizer)
        model = build_model(eos + 1, data.caption_ids.shape[-1] + 1, args.seed)
        optimizers = (None, None)
        if args.clipshard_adamw:
            optimizers = (clipshard.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1), None)
        with tempfile.TemporaryDirectory() as out:
            training = transformers.TrainingArguments(
                output_dir=out, per_device_train_batch_size=args.batch_size // world_size, max_steps=args.steps,
                learning_rate=args.lr, warmup_steps=10, lr_scheduler_type="cosine", weight_decay=0.1,
                logging_steps=max(1, args.steps // 5), seed=args.seed, use_cpu=True, report_to=[],
                save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
                train_sampling_strategy="sequential",
                ddp_find_unused_parameters=False, dataloader_num_workers=0, bf16=args.bf16,
                activation_checkpointing=args.gradient_checkpointing,
                activation_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None)
            trainer = transformers.Trainer(model=model, args=training, data_collator=collate, optimizers=optimizers,
                                           train_dataset=DigitPairs(data, eos, args.steps, args.batch_size, args.seed))
            started = time.perf_counter()
            result = trainer.train()
        return {"accuracy": zero_shot_accuracy(model, data, eos), "loss": result.training_loss,
                "seconds": time.perf_counter() - started}
    finally:
        if patch is not None:
            patch.undo()


def main(argv=None):
    args = build_parser().parse_args(argv)
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if args.batch_size % world_size:
        raise SystemExit(f"train_hf_clip.py: --batch-size {args.batch_size} must be a multiple of the "
                         f"{world_size} ranks")
    torch.set_num_threads(1)
    data = load_digits_data()
    results = {run: train(run, args, data, world_size) for run in args.runs}
    if rank == 0:
        local = args.batch_size // world_size
        print(f"\n{world_size} ranks, global batch {args.batch_size} ({local} per rank), {args.steps} steps, "
              f"zero-shot accuracy on {len(data.test_labels)} held-out digits ({len(NUMBER_WORDS)} classes):")
        for run, r in results.items():
            negatives = (args.batch_size if run == "clipshard" else local) - 1
            print(f"  {RUNS[run]:<45} {negatives:>4} negatives per pair: accuracy {r['accuracy']:.3f}, "
                  f"mean training loss {r['loss']:.3f}, {r['seconds']:.0f} s")


if __name__ == "__main__":
    main()
