"""`python -m clipshard`: the environment report and the kernel self-check (docs/self_check.md).

- environment.py: versions, build kind and compiled architectures, devices, the "auto" picks, CLIPSHARD_* variables;
- kernel_checks.py: the CHECKS table, one check per compiled kernel: loss_checks.py (the losses, against
  the torch path in fp64) and bit_checks.py (stochastic rounding and AdamW: rules and known answers),
  each yielding measurement.py's Measurement rows;
- self_check.py: runs the checks on every visible device, the table, the exit status, --json.
"""
from clipshard.diagnostics.self_check import self_check

__all__ = ["self_check"]
