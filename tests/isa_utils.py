"""Run a script once per CPU code path of the kernels (CLIPSHARD_CPU_ISA narrows the choice of
AVX-512 / AVX2 / baseline; a CPU without AVX-512 runs its best path twice)."""
import os
import subprocess
import sys

import torch

import clipshard

ISA_CHOICES = ("", "avx2", "baseline")  # "" = the best the CPU has


def run_under_each_isa(script: str, tmp_path) -> dict:
    """Runs `python -c script OUT` under each ISA choice; returns {isa: torch.load(OUT)}."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(clipshard.__file__)))
    results = {}
    for isa in ISA_CHOICES:
        env = dict(os.environ, CLIPSHARD_CPU_ISA=isa, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        path = tmp_path / f"isa_{isa or 'best'}.pt"
        subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True)
        results[isa] = torch.load(path)
    return results


def assert_same_bits_on_every_isa(results: dict) -> None:
    for isa in ISA_CHOICES[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[""], results[isa], strict=True)), isa
