"""Digits paired with captions, a word-level tokenizer, and deterministic per-rank batches.

Every batch is a pure function of (seed, step, rank): which images and which caption templates a
step uses is drawn from generators seeded by the step, so a resumed run reads exactly the data an
uninterrupted run would have read, with no sampler state to save.
"""
import functools
from dataclasses import dataclass

import torch

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]

# "{n}" is filled with the number as a word or as a numeral (each with probability 1/2).
CAPTION_TEMPLATES = [
    "a handwritten {n}",
    "the digit {n} written by hand",
    "a scan of a handwritten {n}",
    "a small picture of the number {n}",
    "a pixelated {n}",
    "someone wrote the number {n}",
    "a tiny grey image of a {n}",
    "the handwritten digit {n}",
    "a low resolution scan of the digit {n}",
    "this is a {n}",
]


def zero_shot_prompt(digit: int) -> str:
    """The prompt that stands for a class at evaluation time."""
    return f"a handwritten {NUMBER_WORDS[digit]}"


def all_captions() -> list[list[str]]:
    """captions[d] lists every caption of digit d: each template with the word, then the numeral."""
    return [[t.format(n=word) for t in CAPTION_TEMPLATES] + [t.format(n=str(d)) for t in CAPTION_TEMPLATES]
            for d, word in enumerate(NUMBER_WORDS)]


class Tokenizer:
    """Word-level tokenizer over the captions' vocabulary; id 0 pads, id 1 is an unknown word."""

    PAD, UNK = 0, 1

    def __init__(self, sentences: list[str]):
        words = sorted({w for s in sentences for w in s.lower().split()})
        self.vocab = {"<pad>": self.PAD, "<unk>": self.UNK}
        for w in words:
            self.vocab[w] = len(self.vocab)
        self.max_length = max(len(s.split()) for s in sentences)

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, sentences: list[str]) -> torch.Tensor:
        """int64 ids of shape (len(sentences), max_length), right-padded with PAD."""
        ids = torch.full((len(sentences), self.max_length), self.PAD, dtype=torch.int64)
        for row, sentence in enumerate(sentences):
            words = sentence.lower().split()
            if len(words) > self.max_length:
                raise ValueError(f"Tokenizer.encode: '{sentence}' has {len(words)} words, "
                                 f"at most {self.max_length} fit")
            ids[row, :len(words)] = torch.tensor([self.vocab.get(w, self.UNK) for w in words])
        return ids


@dataclass
class DigitsData:
    train_images: torch.Tensor   # (N_train, 1, 8, 8) float32 in [0, 1]
    train_labels: torch.Tensor   # (N_train,) int64
    test_images: torch.Tensor    # held out: never used for training
    test_labels: torch.Tensor
    caption_ids: torch.Tensor    # (10, C, L) token ids: C captions of each digit
    prompt_ids: torch.Tensor     # (10, L) token ids of the zero-shot prompts
    tokenizer: Tokenizer

    def to(self, device: torch.device) -> "DigitsData":
        tensors = {k: v.to(device) for k, v in vars(self).items() if torch.is_tensor(v)}
        return DigitsData(**tensors, tokenizer=self.tokenizer)


SPLIT_SEED = 0  # the held-out split is the same whatever --seed is


@functools.lru_cache(maxsize=1)  # parse_args asks for the split's size before training loads it
def load_digits_data(test_fraction: float = 0.2) -> DigitsData:
    """scikit-learn's bundled 8x8 digits (1797 images, no download), split per class. Cached: one
    DigitsData per process, whose tensors callers read and never modify."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    generator = torch.Generator().manual_seed(SPLIT_SEED)
    test_mask = torch.zeros(len(labels), dtype=torch.bool)
    for d in range(10):  # stratified: the same fraction of every digit is held out
        members = (labels == d).nonzero().squeeze(1)
        chosen = members[torch.randperm(len(members), generator=generator)]
        test_mask[chosen[:round(test_fraction * len(members))]] = True
    captions = all_captions()
    prompts = [zero_shot_prompt(d) for d in range(10)]
    tokenizer = Tokenizer([c for per_digit in captions for c in per_digit] + prompts)
    caption_ids = torch.stack([tokenizer.encode(per_digit) for per_digit in captions])
    return DigitsData(images[~test_mask], labels[~test_mask], images[test_mask], labels[test_mask],
                      caption_ids, tokenizer.encode(prompts), tokenizer)


def global_batch_indices(num_train: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """Training-set indices of global batch `step`: epochs are fresh permutations, partial tails dropped."""
    per_epoch = num_train // batch_size
    epoch, position = divmod(step, per_epoch)
    order = torch.randperm(num_train, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return order[position * batch_size:(position + 1) * batch_size]


def rank_batch(data: DigitsData, batch_size: int, seed: int, step: int, rank: int, world_size: int):
    """This rank's shard (images, token ids, labels) of global batch `step`, captions drawn at random."""
    indices = global_batch_indices(len(data.train_labels), batch_size, seed, step)
    local = batch_size // world_size
    indices = indices[rank * local:(rank + 1) * local].to(data.train_labels.device)
    labels = data.train_labels[indices]
    # Caption choice depends on (seed, step, rank) only, so it is reproducible after a resume.
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1024 + rank)
    which = torch.randint(data.caption_ids.shape[1], (local,), generator=generator).to(labels.device)
    return data.train_images[indices], data.caption_ids[labels, which], labels


def contrastive_loss_floor(data: DigitsData, batch_size: int, seed: int, steps: int, targets: str | None = None,
                           samples: int = 50) -> float:
    """The lowest expected loss any model can reach on these batches.

    A caption says which digit, not which image: an image whose digit appears k times in the
    global batch cannot tell its own caption from the other k - 1, so its row (and column) costs
    at least log k. Averaged over `samples` of the run's batches. The same holds for targets
    "multi" (the digit as sample id; the row term is lse - mean of the k same-digit logits, at
    least log k, reached when those k are equal and the others far below). With "mask" the other
    k - 1 leave the denominator, so the floor is 0 (approached as other digits' logits fall)."""
    if targets == "mask":
        return 0.0
    floors = []
    for step in torch.linspace(0, steps - 1, min(samples, steps)).long().tolist():
        labels = data.train_labels[global_batch_indices(len(data.train_labels), batch_size, seed, step)]
        floors.append(torch.bincount(labels, minlength=10)[labels].double().log().mean().item())
    return sum(floors) / len(floors)


def num_train_images() -> int:
    """How many images the training split has (the largest possible global batch)."""
    return len(load_digits_data().train_labels)
