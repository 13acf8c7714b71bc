"""Single-device differentiable ops: each is a compiled kernel (CPU C++, CUDA) registered with torch
plus its portable PyTorch twin (algorithm="torch"), with fake kernels and autograd.

- contrastive_lse.py: row LSE, positive logits and partial column LSE of one block (ClipLoss's op);
- siglip_sum.py: the sigmoid loss of one block and its gradients (SigLipLoss's op);
- distill_lse.py: the student's and the teachers' row and column statistics of one block
  (DistillClipLoss's op; compiled kernels where the build has them);
- same_id.py: the sums of a block's same-id logits (targets "multi");
- portable_lse.py, portable_siglip.py, portable_distill.py, _portable_chunks.py: their torch paths;
- stochastic_round.py, adamw_step.py: the registrations of the rounding and AdamW ops (their
  public functions are clipshard.rounding's and clipshard.optim's);
- inputs.py: the input rules of every layer; seeds.py: the (seed, offset) pairs of the random
  streams; _algorithm.py ("auto" -> compiled or torch; its public functions are this package's),
  _workspace.py (chunk widths: chunk_columns, which the memory planner's workspace rules use too);
  planned_device.py (whose device rules apply while clipshard.plan_memory traces).

This is the one layer that registers torch.library ops. Imports: torch and clipshard._C only;
never clipshard.parallel, the losses, optim or the wings (tests/test_package_layout.py checks this).
"""
from clipshard.ops._algorithm import check_algorithm, explain_auto, has_compiled_kernel
from clipshard.ops._workspace import chunk_columns

__all__ = ["check_algorithm", "chunk_columns", "explain_auto", "has_compiled_kernel"]
