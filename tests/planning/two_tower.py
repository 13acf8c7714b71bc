"""A small two-tower model that is not open_clip's (an MLP over 8 x 8 images, a token embedding
and an MLP over texts), its inputs for plan_memory's `inputs=`, and its measured GradCache step on
a rank: the 2-rank test of tests/planning/test_step_plan.py; and the measured two steps every
test there compares its plan with."""
import torch
import torch.nn.functional as F

import clipshard
from clipshard.planning.measured_peak import measured_peak_bytes


def measured_two_steps(step, optimizer, images, texts, autocast=None):
    """The measured peak of two real GradCache steps (forward under `autocast` if given, backward,
    optimizer step, gradients set to None), above what is allocated when they start."""
    def two_steps():
        for _ in range(2):
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = step(images, texts)
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return measured_peak_bytes(two_steps, "cpu")

BATCH, MICRO, TOKENS, VOCAB = 22, 4, 16, 300


class TwoTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.image = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 256), torch.nn.GELU(),
                                         torch.nn.Linear(256, 32))
        self.token = torch.nn.Embedding(VOCAB, 64)
        self.text = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, images, texts):
        return {"image_features": F.normalize(self.image(images), dim=-1),
                "text_features": F.normalize(self.text(self.token(texts)).mean(1), dim=-1),
                "logit_scale": self.logit_scale.exp()}


def inputs(batch_size):
    return torch.empty(batch_size, 3, 8, 8), torch.empty(batch_size, TOKENS, dtype=torch.int64)


def cache(model):
    return clipshard.GradCache(model, clipshard.ClipLoss(mode="ring"), micro_batch_size=MICRO)


def measured_on_rank(rank, world_size):
    """The peak above the start of two real steps on this rank, its weights and batch allocated before."""
    torch.manual_seed(rank)
    model = TwoTower()
    step, optimizer = cache(model), clipshard.optim.AdamW(model.parameters())
    images, texts = torch.randn(BATCH, 3, 8, 8), torch.randint(0, VOCAB, (BATCH, TOKENS))

    return measured_two_steps(step, optimizer, images, texts)
