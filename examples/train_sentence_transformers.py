"""Train a tiny embedding model with sentence-transformers' SentenceTransformerTrainer and
MultipleNegativesRankingLoss(gather_across_devices=True), with or without clipshard's patch.

Nothing is downloaded: the model (a 2-layer BERT) is built from a config and the tokenizer (a
word-level one) from the synthetic corpus, both saved to a temporary directory that
sentence-transformers loads. The data are (anchor, positive, negative) triplets of random words;
in the ids runs each triplet also has an integer "label" column, its topic id, which the patch reads as
sample ids (apply_to_sentence_transformers(labels_as_ids=...)).

    torchrun --nproc-per-node 2 examples/train_sentence_transformers.py --out runs.json own clipshard ids-mask

RUN: own (the library's loss), clipshard (apply_to_sentence_transformers()), ids-mask / ids-multi (the
patch with labels_as_ids="mask" / "multi" and the topic ids as the label column). Each run builds the
same model and data. Rank 0 writes {RUN: {"losses": [the loss the Trainer logged at each step],
"seconds": training time}} to --out and prints it. Same seed and data order (sequential sampling) on
any number of ranks; no dropout.
"""
import argparse
import json
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))  # clipshard from the checkout

import torch  # noqa: E402

WORDS = [f"w{k}" for k in range(60)]
RUNS = {"own": None, "clipshard": None, "ids-mask": "mask", "ids-multi": "multi"}  # run -> labels_as_ids
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def save_tiny_model(directory, seed):
    """A tiny BERT and a word-level tokenizer, saved in `directory` (before torch.distributed starts:
    transformers saves on the main process only once it has)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: k for k, token in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                                model_max_length=32)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    transformers.BertModel(config).save_pretrained(directory)
    fast.save_pretrained(directory)


def load_model(directory):
    """The saved model as a SentenceTransformer: Transformer + mean pooling."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(directory)
    return SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension())], device="cpu")


def triplets(count, seed, with_ids):
    """(anchor, positive, negative) triplets: the anchor and its positive share words of one of
    count // 2 topics (so ids repeat); the negative is drawn from another topic."""
    rng = random.Random(seed)
    topics = [rng.sample(WORDS, 8) for _ in range(max(2, count // 2))]
    rows = {"anchor": [], "positive": [], "negative": []}
    if with_ids:
        rows["label"] = []
    for _ in range(count):
        topic = rng.randrange(len(topics))
        other = (topic + 1 + rng.randrange(len(topics) - 1)) % len(topics)
        rows["anchor"].append(" ".join(rng.sample(topics[topic], 4)))
        rows["positive"].append(" ".join(rng.sample(topics[topic], 4)))
        rows["negative"].append(" ".join(rng.sample(topics[other], 4)))
        if with_ids:
            rows["label"].append(topic)
    return rows


def train(model_directory, clipshard_patch, ids, steps, global_batch, world_size):
    """The per-step losses the Trainer logs, and the training seconds."""
    import datasets
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    import clipshard

    patch = clipshard.apply_to_sentence_transformers(labels_as_ids=ids) if clipshard_patch else None
    try:
        with tempfile.TemporaryDirectory() as directory:
            model = load_model(model_directory)
            data = datasets.Dataset.from_dict(triplets(steps * global_batch, seed=1, with_ids=ids is not None))
            loss = MultipleNegativesRankingLoss(model, gather_across_devices=True)
            args = SentenceTransformerTrainingArguments(
                output_dir=os.path.join(directory, "out"), per_device_train_batch_size=global_batch // world_size,
                max_steps=steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                seed=0, dataloader_drop_last=True, use_cpu=True, disable_tqdm=True,
                **_sequential(SentenceTransformerTrainingArguments))
            trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)
            start = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - start
            losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    finally:
        if patch is not None:
            patch.undo()
    return losses, seconds


def _sequential(arguments_class):
    """Sequential sampling (the same batches on any number of ranks), by this release's option name."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(arguments_class)}
    return {"train_sampling_strategy": "sequential"} if "train_sampling_strategy" in fields else {}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", choices=RUNS, help="what to train, in turn")
    parser.add_argument("--out", help="JSON file for rank 0's per-step losses")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=16)
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    results = {"world_size": world_size}
    with tempfile.TemporaryDirectory() as directory:
        save_tiny_model(directory, seed=0)
        for run in args.runs:
            losses, seconds = train(directory, run != "own", RUNS[run], args.steps, args.global_batch, world_size)
            results[run] = {"losses": losses, "seconds": seconds}
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(results))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f)


if __name__ == "__main__":
    main()
