"""The ops of clipshard.ops run over ranks with torch.distributed.

- collectives.py: the metadata exchange (checks on every rank before any collective), all-gather /
  reduce-scatter with autograd, the column LSE all-reduce;
- exchange.py: the gathered modes of ClipLoss (local and exchange);
- ring.py, siglip_ring.py, _ring_pass.py: ring mode of ClipLoss and SigLipLoss over one shared
  point-to-point pass;
- distill_exchange.py, distill_ring.py: DistillClipLoss's gathered modes and ring mode.

Imports: clipshard.ops and top-level helpers; never the public loss modules or integrations.
"""
