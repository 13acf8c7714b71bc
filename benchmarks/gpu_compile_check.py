"""The GPU check of the compiled distributed loss (benchmarks/gpu_check.sh; docs/distributed.md,
"Compiling and host syncs"): on one GPU, an NCCL group of one rank, ClipLoss and SigLipLoss (the
metadata header gathered and checked on the GPU, the loss through the group's code path):

- host reads per steady call, eager, validate="every_call" and "on_change"
  (clipshard.diagnostics.host_reads: `.item()`, `.tolist()`, blocking copies host <-> device);
- torch.compile(fullgraph=True) (inductor) of the loss: no graph break, the same loss and gradients
  as eager (fp32 within 1e-5), and the time of a forward + backward, compiled against eager.

A group of one rank runs no feature collective (the loss is the single-device one after the
validation); the multi-rank paths are tested on gloo (tests/parallel/test_compile_distributed.py).

    python benchmarks/gpu_compile_check.py [--batch 4096] [--dim 512]
"""
import argparse
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _timed(fn, repeats):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main(argv=None):
    import clipshard
    import torch._dynamo
    from clipshard.diagnostics.host_reads import HostReads

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_compile_check: no CUDA device")
        return 2
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    gen = torch.Generator(device="cuda").manual_seed(0)
    image, text = torch.nn.functional.normalize(
        torch.randn(2, args.batch, args.dim, device="cuda", generator=gen), dim=-1).unbind(0)
    image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
    scale = torch.tensor(14.3, device="cuda", requires_grad=True)
    bias = torch.tensor(-2.0, device="cuda", requires_grad=True)
    failures = 0
    losses = {"ClipLoss": lambda v: clipshard.ClipLoss(True, True, group=dist.group.WORLD, validate=v),
              "SigLipLoss": lambda v: clipshard.SigLipLoss(group=dist.group.WORLD, validate=v)}
    for name, make in losses.items():
        inputs = (image, text, scale) + ((bias,) if name == "SigLipLoss" else ())

        def step(loss_fn):
            for t in inputs:
                t.grad = None
            value = loss_fn(*inputs)
            value.backward()
            return [value.detach()] + [t.grad for t in inputs]

        for validate in ("every_call", "on_change"):
            loss_fn = make(validate)
            step(loss_fn)
            with HostReads() as reads:
                step(loss_fn)
            print(f"{name} validate={validate!r}: {reads.count} host reads per steady forward + backward "
                  f"({', '.join(reads.events) or 'none'})")
        eager = make("on_change")
        torch._dynamo.reset()
        breaks = torch._dynamo.explain(eager)(*inputs).graph_break_count
        compiled = torch.compile(eager, fullgraph=True)
        reference, got = step(eager), step(compiled)
        worst = max(float((a - b).abs().max() / max(1.0, float(a.abs().max()))) for a, b in zip(reference, got))
        with HostReads() as reads:
            step(compiled)
        t_eager, t_compiled = _timed(lambda: step(eager), args.repeats), _timed(lambda: step(compiled), args.repeats)
        ok = breaks == 0 and worst <= 1e-5
        failures += not ok
        print(f"{name} compiled: {'ok' if ok else 'FAILED'}: {breaks} graph breaks, compiled vs eager {worst:.2e}, "
              f"{reads.count} host reads per compiled call; forward + backward at B = {args.batch}, D = {args.dim}: "
              f"eager {t_eager * 1e3:.2f} ms, compiled {t_compiled * 1e3:.2f} ms")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
