"""The ops of clipshard.ops run over ranks with torch.distributed; speaks no loss's words (the
losses pass the names and descriptions in).

- layout.py: the process group, ShardLayout (where each rank's rows sit), the metadata device;
- agreement.py: one metadata row per rank in one all-gather, raising on every rank when a rank has
  a problem or ranks disagree (the losses' cross-rank validation and raise_on_every_rank);
- collectives.py: all-gather / reduce-scatter with autograd, the column LSE all-reduce, sums;
- exchange.py: the gathered modes of ClipLoss (local and exchange);
- ring.py, siglip_ring.py, _ring_pass.py: ring mode of ClipLoss and SigLipLoss over one shared
  point-to-point pass;
- distill_exchange.py, distill_ring.py: DistillClipLoss's gathered modes and ring mode.

Imports: clipshard.ops only; never the losses, grad_cache, integrations or diagnostics.
"""
