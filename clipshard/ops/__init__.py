"""Single-device differentiable ops: each is a compiled kernel (CPU C++, CUDA) registered with torch
plus its portable PyTorch twin (algorithm="torch"), with fake kernels and autograd.

- contrastive_lse.py: row LSE, positive logits and partial column LSE of one block (ClipLoss's op);
- siglip_sum.py: the sigmoid loss of one block and its gradients (SigLipLoss's op);
- distill_lse.py: the student's and the teachers' row and column statistics of one block
  (DistillClipLoss's op; compiled kernels where the build has them);
- portable_lse.py, portable_siglip.py, portable_distill.py, _portable_chunks.py: their torch paths;
- _algorithm.py ("auto" -> compiled or torch), _workspace.py (chunk widths), _block_checks.py.

Imports: torch, clipshard._C and clipshard's top-level helpers (_checks) only; never clipshard.parallel,
the losses or integrations (tests/test_package_layout.py checks this).
"""
