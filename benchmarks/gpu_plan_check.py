"""Memory plans against the CUDA caching allocator's peaks (the GPU check's step; docs/scale.md).

For each loss and option at moderate sizes on one GPU (one process: world size 1), the planned
peak (clipshard.plan_memory(..., device="cuda"), traced on the CPU with CUDA's rules) against the
peak of torch.cuda.max_memory_allocated over a real forward + backward, after one untimed warm-up
call (first-use checks and cuBLAS's workspace are then allocated already, before the baseline).
Prints one line per case and exits 1 when one is off by more than 10 % + 256 KiB.

    PYTHONPATH=. python benchmarks/gpu_plan_check.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import clipshard  # noqa: E402
from clipshard.planning import format_bytes, plan_memory  # noqa: E402
from clipshard.planning.measured_peak import measured_peak_bytes  # noqa: E402

TOLERANCE, SLACK = 0.10, 256 << 10


def _cases():
    for dtype in (torch.float32, torch.bfloat16):
        yield clipshard.ClipLoss(), 8192, 768, dtype, {}
        yield clipshard.ClipLoss(), 4099, 512, dtype, dict(hard_negatives=1000, sample_ids=True)
        # few rows against many columns: the chunk driver's column-gradient buffer is M columns wide
        yield clipshard.ClipLoss(), 300, 768, dtype, dict(hard_negatives=20000)
        yield clipshard.ClipLoss(direction="image_to_text"), 4099, 512, dtype, {}
        yield clipshard.SigLipLoss(), 8192, 768, dtype, {}
        yield clipshard.SigLipLoss(), 4099, 512, dtype, dict(hard_negatives=1000, sample_ids=True)
        yield clipshard.DistillClipLoss(), 4099, 512, dtype, {}


def _real_call(loss, batch, dim, dtype, options):
    generator = torch.Generator(device="cuda").manual_seed(0)

    def leaf(*shape, dt=dtype):
        return torch.randn(*shape, generator=generator, device="cuda", dtype=dt).requires_grad_()

    image, text, scale = leaf(batch, dim), leaf(batch, dim), torch.tensor(10.0, device="cuda", requires_grad=True)
    extras = {}
    if options.get("hard_negatives"):
        extras["hard_negatives"] = leaf(options["hard_negatives"], dim)
    if options.get("sample_ids"):
        extras["sample_ids"] = torch.randint(0, batch // 3, (batch,), generator=generator, device="cuda")
    if isinstance(loss, clipshard.DistillClipLoss):
        teacher = (leaf(batch, dim).detach(), leaf(batch, dim).detach(), torch.tensor(20.0, device="cuda"))
        return lambda: sum(loss(image, text, scale, *teacher)).backward()
    if isinstance(loss, clipshard.SigLipLoss):
        bias = torch.tensor(-10.0, device="cuda", requires_grad=True)
        return lambda: loss(image, text, scale, bias, **extras).backward()
    return lambda: loss(image, text, scale, **extras).backward()


def main():
    if not torch.cuda.is_available():
        print("gpu_plan_check: no CUDA device")
        return 2
    failures = 0
    for loss, batch, dim, dtype, options in _cases():
        call = _real_call(loss, batch, dim, dtype, options)
        call()  # warm-up: first-use checks, cuBLAS workspace
        measured = max(measured_peak_bytes(call, "cuda") for _ in range(2))
        planned = plan_memory(loss, world_size=1, batch_size=batch, dim=dim, dtype=dtype, device="cuda",
                              **options).peak_bytes
        ok = abs(planned - measured) <= TOLERANCE * measured + SLACK
        failures += not ok
        name = f"{type(loss).__name__}({getattr(loss, 'direction', '')}) M={batch} D={dim} {dtype} {options}"
        print(f"{'ok ' if ok else 'OFF'} {name}: planned {format_bytes(planned)}, measured {format_bytes(measured)}, "
              f"ratio {planned / measured:.3f}", flush=True)
    print(f"plan vs CUDA peak: {failures} of {len(list(_cases()))} cases off by more than 10 % + 256 KiB")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
