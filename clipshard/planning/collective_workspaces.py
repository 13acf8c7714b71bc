"""The staging buffers a process-group backend allocates inside a collective (docs/scale.md).

A plan's fake process group moves nothing, so its collectives allocate nothing beyond their
outputs. The backend a CPU plan stands for, gloo, stages two of the collectives the losses use
through torch tensors (measured with torch.profiler on gloo ranks): a reduce-scatter into one
tensor (the gathers' backward) first copies its whole input, and an all-gather into one tensor
fills a staging tensor of the output's size. Both are alive while the collective runs. NCCL, the
backend of a CUDA plan, reduces and gathers in place: no staging.
"""

# operator name -> rule(output, input) -> [(what, bytes), ...], for gloo (CPU plans)
_GLOO = {
    "c10d::_reduce_scatter_base_": lambda output, input: [("gloo: a copy of the input", _nbytes(input))],
    "c10d::_allgather_base_": lambda output, input: [("gloo: a staging output", _nbytes(output))],
}


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


def internal_allocations(func, device_type, args):
    """[(what, bytes), ...]: the backend's staging buffers inside the collective `func` (a c10d
    operator, its output and input tensors first) on `device_type`; [] for any other op."""
    rule = _GLOO.get(func.name().removesuffix(".default")) if device_type == "cpu" else None
    return [] if rule is None else rule(args[0], args[1])
