"""Memory plans: how much memory a clipshard loss (or a GradCache step) takes on each of N ranks,
found by running clipshard's own code on fake tensors in a fake world of N ranks (docs/scale.md)."""
import torch

from clipshard.planning.memory_plan import MemoryPlan, format_bytes

__all__ = ["MemoryPlan", "format_bytes", "plan_memory"]


def plan_memory(loss, *, world_size, batch_size, dim=None, dtype=None, hard_negatives=0, sample_ids=False,
                targets=None, device="cuda", teacher_dim=None, optimizer=None, autocast=None, inputs=None, model=None,
                batch_on_device=True):
    """One rank's peak memory of the loss's forward + backward (or of a GradCache step), planned.

    Args:
        loss: a constructed ClipLoss (any mode and options), SigLipLoss or DistillClipLoss; or a
            clipshard.GradCache, whose training step is planned (clipshard/planning/step_plan.py).
        world_size: the number of ranks N (1: one process).
        batch_size: the local batch M, the same on every rank (the global batch is N * M).
        dim: the feature size D (a loss; a GradCache's model gives its own).
        dtype: the features' dtype (torch dtype or 'fp32', 'fp16', 'bf16', 'fp64'; default fp32; a
            loss only: a GradCache step's dtypes are the model's, under `autocast`).
        hard_negatives: hard negatives per rank (H x D, like the texts); 0 for none (a loss only).
        sample_ids: plan the call with sample ids.
        targets: with sample_ids, the call's targets ("mask" or "multi"; None: the loss's default).
        device: 'cuda' or 'cpu': whose kernels and workspace defaults the plan uses.
        teacher_dim: DistillClipLoss: the teacher's feature size (default: dim).
    A GradCache step only:
        optimizer: None (weights and gradients only), 'clipshard' (clipshard.optim.AdamW with its
            defaults: fp32 moments for fp32 weights), 'torch' (torch.optim.AdamW), or a callable
            that builds one from the parameters, e.g. `lambda p: clipshard.optim.AdamW(p,
            state_dtype=torch.bfloat16)`.
        autocast: None, or torch.bfloat16 / torch.float16 ('bf16', 'fp16'): the step runs under autocast.
        inputs: a callable batch_size -> (images, texts), the model's inputs for a batch (default:
            open_clip's images and token ids, from the model's image size and context length).
        model: a callable that builds the model, called inside the plan's fake mode, in place of
            the GradCache's model (which may also be a module on the meta device).
        batch_on_device: True: the local batch of inputs is on the device before the step (counted,
            as the weights, in counted_before and peak_bytes); False: each micro-batch is copied there.

    Returns:
        MemoryPlan: peak_bytes (the peak of the bytes allocated from just before the forward to the
        end of the backward: the gathered or ring-passed blocks, LSEs, kernel workspaces, the
        inputs' gradients; not the input features themselves. A GradCache step: the peak over the
        step, its weights and inputs (counted_before) included), peak_allocations, report().
    """
    from clipshard.grad_cache import GradCache
    if isinstance(loss, GradCache):
        from clipshard.planning.step_plan import plan_step
        if dim is not None or dtype is not None or hard_negatives or teacher_dim is not None:
            raise ValueError("plan_memory: a GradCache step takes its feature size and dtypes from the model; "
                             "leave dim, dtype, hard_negatives and teacher_dim out (use autocast= for 16-bit compute)")
        return plan_step(loss, world_size=world_size, batch_size=batch_size, device=device, optimizer=optimizer,
                         autocast=autocast, inputs=inputs, model=model, batch_on_device=batch_on_device,
                         sample_ids=sample_ids)
    if (optimizer, autocast, inputs, model, batch_on_device) != (None, None, None, None, True):
        raise ValueError("plan_memory: optimizer, autocast, inputs, model and batch_on_device plan a GradCache "
                         "step; a loss is planned without them")
    from clipshard.planning.loss_plan import plan_loss
    return plan_loss(loss, world_size=world_size, batch_size=batch_size, dim=dim,
                     dtype=torch.float32 if dtype is None else dtype, hard_negatives=hard_negatives,
                     sample_ids=sample_ids, targets=targets, device=device, teacher_dim=teacher_dim)
