"""Zero-shot accuracy, and the peak memory of one contrastive-loss call."""
import torch

from clipshard.planning.measured_peak import measured_peak_bytes


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


def peak_loss_memory(loss_fn, image_features: torch.Tensor, text_features: torch.Tensor,
                     logit_scale: torch.Tensor, repeats: int = 3) -> int:
    """Bytes allocated at the peak of one loss forward + backward, beyond its inputs; the largest
    of `repeats` calls (with gloo, when a collective's buffers are freed varies by a few tens of KiB
    from call to call).

    clipshard.planning.measured_peak: CUDA's max_memory_allocated around the call; on the CPU the
    allocation events of torch.profiler, replayed in order. Every rank must call this together (the loss talks to the other ranks).
    """
    return max(_peak_of_one_call(loss_fn, image_features, text_features, logit_scale) for _ in range(repeats))


def _peak_of_one_call(loss_fn, image_features, text_features, logit_scale) -> int:
    image_features = image_features.detach().requires_grad_()
    text_features = text_features.detach().requires_grad_()
    logit_scale = logit_scale.detach().requires_grad_()

    def call():
        loss_fn(image_features, text_features, logit_scale).backward()

    return measured_peak_bytes(call, image_features.device)
