"""The CUDA stochastic-rounding kernels (csrc/cuda/stochastic_round_kernels.cuh), run on the CPU.

tests/cuda_emulation/emulate_stochastic_round.cpp compiles them as host code (emulate_cuda.h) and
rounds the cases written here; every result must have the CPU kernel's bits: both kernels (the
vectorised one for 16-byte aligned tensors, the scalar one at any alignment), fp16 and bf16, with
and without saturation, sizes around the 8-element groups and the tails, one CTA and an H200's grid
(min(blocks, 132 SMs x 8)), and every special value (NaNs of other payloads and signs are stored as
the canonical NaN). A copy of the vectorised kernel that drops the second half of its tail fails.
What only a GPU shows is left to tests/ops/test_stochastic_round_cuda.py."""
import subprocess

import numpy as np
import pytest
import torch

import clipshard  # noqa: F401  (registers torch.ops.clipshard.*)
from clipshard.ops.seeds import as_int64
from tests.cuda_emulation.emulation_utils import HARNESSES, build_real_and_broken

HARNESS = HARNESSES / "emulate_stochastic_round.cpp"
THREADS, H200_SMS = 256, 132
SEED, OFFSET = 0xFEED_BEEF_0000_1234, 99


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory):
    return build_real_and_broken(tmp_path_factory.mktemp("sr_emulation"), HARNESS, "stochastic_round_kernels.cuh",
                                 "if (first < 2 && 4 * first < tail) {", "if (first < 1 && 4 * first < tail) {")


def _values(n, seed):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, dtype=torch.float64, generator=generator)
         * 10.0 ** torch.randint(-9, 6, (n,), generator=generator)).float()
    specials = np.array([0x7FC00000, 0xFFC00001, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001,
                         0x477FF000, 0x477FEFFF, 0x7F7FFFFF, 0x33800000, 0x387FC000], dtype=np.uint32)
    k = min(n, len(specials))
    x[:k] = torch.from_numpy(specials[:k].view(np.float32))
    return x


def _cases():
    cases = []
    for index, n in enumerate([1, 7, 8, 13, 1001, 8 * THREADS * 3 + 6]):
        for bf16 in (False, True):
            saturate = index % 2 == 1
            blocks_vector = max(n // 8, 1)
            grid = min((blocks_vector + THREADS - 1) // THREADS, H200_SMS * 8)
            cases.append(dict(n=n, bf16=bf16, saturate=saturate, vectorized=True, grid=grid, misalign=0))
            cases.append(dict(n=n, bf16=bf16, saturate=not saturate, vectorized=False, grid=1, misalign=1 + index % 3))
    cases.append(dict(n=8 * THREADS * 3 + 6, bf16=False, saturate=False, vectorized=True, grid=1, misalign=0))
    for i, c in enumerate(cases):
        c["x"] = _values(c["n"], seed=i)
    return cases


def _run(exe, cases, folder):
    folder.mkdir(exist_ok=True)
    lines = [str(len(cases))] + [f"{c['n']} {int(c['bf16'])} {int(c['saturate'])} {SEED} {OFFSET} "
                                 f"{int(c['vectorized'])} {c['grid']} {c['misalign']}" for c in cases]
    (folder / "cases.txt").write_text("\n".join(lines) + "\n")
    (folder / "inputs.bin").write_bytes(b"".join(c["x"].numpy().tobytes() for c in cases))
    run = subprocess.run([str(exe), str(folder)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ALL DONE" in run.stdout, run.stdout + run.stderr
    data, at, out = (folder / "outputs.bin").read_bytes(), 0, []
    for c in cases:
        out.append(torch.from_numpy(np.frombuffer(data[at:at + 2 * c["n"]], dtype=np.int16).copy()))
        at += 2 * c["n"]
    return out


def _differing(emulated, cases):
    counts = []
    for got, c in zip(emulated, cases):
        dtype = torch.bfloat16 if c["bf16"] else torch.float16
        want = torch.ops.clipshard.stochastic_round(c["x"], dtype, as_int64(SEED), OFFSET, c["saturate"])
        counts.append(int((got != want.view(torch.int16)).sum()))
    return counts


def test_stochastic_round_cuda_kernels_match_cpu_kernel_bitwise_in_host_emulation(harnesses, tmp_path):
    cases = _cases()
    assert _differing(_run(harnesses[0], cases, tmp_path / "real"), cases) == [0] * len(cases)


def test_stochastic_round_emulation_catches_a_kernel_that_drops_tail_elements(harnesses, tmp_path):
    cases = [c for c in _cases() if c["vectorized"] and c["n"] % 8 > 4]
    assert cases
    assert all(count > 0 for count in _differing(_run(harnesses[1], cases, tmp_path / "broken"), cases))
