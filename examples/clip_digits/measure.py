"""Zero-shot accuracy, and the peak memory of one contrastive-loss call."""
import contextlib
import os
import sys

import torch


@torch.no_grad()
def zero_shot_accuracy(model, images: torch.Tensor, labels: torch.Tensor, prompt_ids: torch.Tensor) -> float:
    """Each image gets the class whose prompt embedding is most similar to it (argmax over ten)."""
    was_training = model.training
    model.eval()
    try:
        classes = model.encode_text(prompt_ids)             # (10, E)
        predicted = (model.encode_image(images) @ classes.T).argmax(dim=1)
    finally:
        model.train(was_training)
    return (predicted == labels).float().mean().item()


@contextlib.contextmanager
def _quiet_native_output():
    """The CPU profiler's native start/stop notices go straight to the file descriptors."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        try:
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _peak_of_allocations(profiler) -> int:
    """Largest running sum of the allocations and frees that the profiler saw, in time order."""
    from torch._C._profiler import _EventType

    sizes, pending = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        if node.tag == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        pending.extend(node.children)
    running = peak = 0
    for _, size in sorted(sizes):
        running += size
        peak = max(peak, running)
    return peak


def peak_loss_memory(loss_fn, image_features: torch.Tensor, text_features: torch.Tensor,
                     logit_scale: torch.Tensor, repeats: int = 3) -> int:
    """Bytes allocated at the peak of one loss forward + backward, beyond its inputs; the largest
    of `repeats` calls (with gloo, when a collective's buffers are freed varies by a few tens of KiB
    from call to call).

    CUDA: max_memory_allocated around the call. CPU: the allocation events of torch.profiler,
    replayed in order. Every rank must call this together (the loss talks to the other ranks).
    """
    return max(_peak_of_one_call(loss_fn, image_features, text_features, logit_scale) for _ in range(repeats))


def _peak_of_one_call(loss_fn, image_features, text_features, logit_scale) -> int:
    image_features = image_features.detach().requires_grad_()
    text_features = text_features.detach().requires_grad_()
    logit_scale = logit_scale.detach().requires_grad_()

    def call():
        loss_fn(image_features, text_features, logit_scale).backward()

    if image_features.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with _quiet_native_output():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            call()
    return _peak_of_allocations(profiler)
