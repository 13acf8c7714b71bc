"""The ring-mode case of test_ring_torchrun.py: run under torchrun (each rank writes its results to
OUT_DIR/rank<r>.pt) or called directly by tests/dist_utils.run_group (the single launch)."""
import os
import sys

import torch
import torch.distributed as dist

import clipshard

SIZES = (7, 5)  # unequal local batches: the blocks travel in both orientations


def ring_case(rank, world_size):
    """Loss and gradients of ring mode (local_loss True and False, fp32 with logit_bias), and exchange
    mode's for reference, on a fixed global batch; as numpy arrays (they pickle by value)."""
    gen = torch.Generator().manual_seed(11)
    total, dim = sum(SIZES), 16
    image = torch.nn.functional.normalize(torch.randn(total, dim, generator=gen), dim=1)
    text = torch.nn.functional.normalize(torch.randn(total, dim, generator=gen) + 0.5 * image, dim=1)
    local = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    out = {}
    for mode in ("ring", "exchange"):
        for local_loss in (True, False):
            leaves = [image[local].clone().requires_grad_(), text[local].clone().requires_grad_(),
                      torch.tensor(20.0, requires_grad=True), torch.tensor(-1.0, requires_grad=True)]
            loss = clipshard.clip_loss(*leaves, local_loss=local_loss, mode=mode)
            (loss * (1.0 + rank)).backward()
            out[mode, local_loss] = [loss.detach().numpy()] + [t.grad.numpy() for t in leaves]
    return out


def main(out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        assert world_size == len(SIZES), f"run with {len(SIZES)} ranks in all, got {world_size}"
        torch.save(ring_case(rank, world_size), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
