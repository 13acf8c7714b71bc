"""`python -m clipshard`: the environment report and the kernel self-check (docs/self_check.md).

- environment.py: versions, build kind and compiled architectures, devices, the "auto" picks, CLIPSHARD_* variables;
- kernel_checks.py: one check function per compiled kernel (the CHECKS table);
- self_check.py: runs the checks on every visible device, the table, the exit status, --json.
"""
from clipshard.diagnostics.self_check import self_check

__all__ = ["self_check"]
