"""The kernel checks of `python -m clipshard`: one named function per compiled kernel.

Each check runs one kernel on a small random problem with odd sizes on one device and yields
Measurement rows: the worst error against what the kernel must give, and the tolerance it must stay
within. The losses (loss_checks.py) are compared with the portable torch path run in fp64;
stochastic rounding and AdamW (bit_checks.py), which promise the same bits on every device, with
the CPU kernel on a GPU and with stated invariants and known answers on the CPU. Nothing here
needs a reference implementation: those live with the tests. "kernel variants" runs the first-use
check's probes (variant_checks.py) over every compiled variant of the loss kernels.

Adding a kernel is one entry in CHECKS: a name, the function, and the device types it runs on.
"""
from clipshard.diagnostics.bit_checks import check_adamw, check_stochastic_round
from clipshard.diagnostics.loss_checks import check_chunked_addmm_branches, check_contrastive_lse, check_distill, \
    check_siglip
from clipshard.diagnostics.measurement import Check, Measurement
from clipshard.diagnostics.variant_checks import check_every_variant

__all__ = ["CHECKS", "Check", "Measurement"]

CHECKS = (
    Check("contrastive_lse", check_contrastive_lse),
    Check("contrastive_lse chunked addmm", check_chunked_addmm_branches),
    Check("siglip_sum", check_siglip),
    Check("distill_lse", check_distill),
    Check("kernel variants", check_every_variant),
    Check("stochastic_round", check_stochastic_round),
    Check("adamw_step_", check_adamw),
)
