"""Memory plans: how much memory a clipshard loss (or a GradCache step) takes on each of N ranks,
found by running clipshard's own code on fake tensors in a fake world of N ranks (docs/scale.md)."""
import torch

from clipshard.planning.memory_plan import MemoryPlan, format_bytes

__all__ = ["MemoryPlan", "format_bytes", "plan_memory"]


def plan_memory(loss, *, world_size, batch_size, dim, dtype=torch.float32, hard_negatives=0, sample_ids=False,
                targets=None, device="cuda", teacher_dim=None):
    """One rank's peak memory of the loss's forward + backward (or of a GradCache step), planned.

    Args:
        loss: a constructed ClipLoss (any mode and options), SigLipLoss or DistillClipLoss.
        world_size: the number of ranks N (1: one process).
        batch_size: the local batch M, the same on every rank (the global batch is N * M).
        dim: the feature size D.
        dtype: the features' dtype (torch dtype or 'fp32', 'fp16', 'bf16', 'fp64').
        hard_negatives: hard negatives per rank (H x D, like the texts); 0 for none.
        sample_ids: plan the call with sample ids.
        targets: with sample_ids, the call's targets ("mask" or "multi"; None: the loss's default).
        device: 'cuda' or 'cpu': whose kernels and workspace defaults the plan uses.
        teacher_dim: DistillClipLoss: the teacher's feature size (default: dim).

    Returns:
        MemoryPlan: peak_bytes (the peak of the bytes allocated from just before the forward to the
        end of the backward: the gathered or ring-passed blocks, LSEs, kernel workspaces, the
        inputs' gradients; not the input features themselves), peak_allocations, report().
    """
    from clipshard.planning.loss_plan import plan_loss
    return plan_loss(loss, world_size=world_size, batch_size=batch_size, dim=dim, dtype=dtype,
                     hard_negatives=hard_negatives, sample_ids=sample_ids, targets=targets, device=device,
                     teacher_dim=teacher_dim)
