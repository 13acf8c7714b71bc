"""The CUDA AdamW kernel and its launcher (csrc/cuda/adamw_kernels.cuh), run on the CPU.

tests/cuda_emulation/emulate_adamw.cpp compiles them as host code (emulate_cuda.h) and steps the
cases written here; every stored bit must equal the CPU kernel's (the promise that CPU == CUDA):
index bases 0-3 mod 4 at every memory alignment, empty and 1-element tensors, a tensor of several
blocks, more tensors than one launch's table, a tensor longer than a table's blocks (with a smaller
table, as the real one would need 21 M elements), NaN and infinite values, every storage pair, with
and without stochastic rounding; a grad or a moment at another alignment than its parameter (FSDP2
shards), `maximize`, and several hyper-parameter sets. The emulated float4 / uint2 count the vector
accesses: every whole group of 4 takes the vector path (4 loads, 3 stores) where each buffer sits at
its parameter's alignment, whatever the shard's index base, and the scalar path for a buffer that
does not. A copy of the
kernel with a deliberate bug (each group's words from one Philox block) fails, so the comparison
can fail. Speed and the real memory system are left to tests/optim/test_adamw_cuda.py on a GPU."""
import subprocess

import numpy as np
import pytest
import torch

import clipshard  # noqa: F401  (registers torch.ops.clipshard.*)
from tests.cuda_emulation.emulation_utils import HARNESSES, broken_copy, build_real_and_broken, finish_builds, start_build

HARNESS = HARNESSES / "emulate_adamw.cpp"
STORAGE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
HYPER = dict(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
# Other parameter groups' settings: a large step with short memories, and no first moment at all.
OTHER_HYPERS = [dict(lr=0.1, beta1=0.5, beta2=0.95, eps=1e-3, weight_decay=0.0),
                dict(lr=3e-5, beta1=0.0, beta2=0.9999, eps=1e-12, weight_decay=0.5)]
SEED, OFFSET = 0x5EED_0123_4567, 3


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory):
    """The harness with the real kernel and with a broken copy (each group's words from one Philox block)."""
    return build_real_and_broken(tmp_path_factory.mktemp("adamw_emulation"), HARNESS, "adamw_kernels.cuh",
                                 "uint32_t w[7] = {low.w[0], low.w[1], low.w[2], low.w[3], high.w[0], high.w[1], high.w[2]};",
                                 "uint32_t w[7] = {low.w[0], low.w[1], low.w[2], low.w[3], low.w[0], low.w[1], low.w[2]};")


def _tensors(numel, param_dtype, state_dtype, generator, specials):
    p = torch.randn(numel, dtype=torch.float64, generator=generator)
    g = 1e-2 * torch.randn(numel, dtype=torch.float64, generator=generator)
    m = 1e-3 * torch.randn(numel, dtype=torch.float64, generator=generator)
    v = 1e-5 * torch.rand(numel, dtype=torch.float64, generator=generator)
    if state_dtype == torch.float16:
        v = v ** 0.25  # fp16 second moments are stored as v^(1/4)
    if specials and numel >= 4:
        g[1], g[2], p[3] = float("nan"), float("inf"), float("-inf")
    return [p.to(param_dtype), g.to(param_dtype), m.to(state_dtype), v.to(state_dtype)]


def _case(param_dtype, state_dtype, sizes, index_bases, misaligns, shape=0, stochastic=True, seed=0, hyper=HYPER,
          maximize=False):
    """misaligns: per tensor, one number for its four buffers or a (param, grad, exp_avg, exp_avg_sq) tuple."""
    generator = torch.Generator().manual_seed(seed)
    misaligns = [m if isinstance(m, tuple) else (m,) * 4 for m in misaligns]
    return {"shape": shape, "param": param_dtype, "state": state_dtype, "stochastic": stochastic,
            "hyper": hyper, "maximize": maximize,
            "tensors": [_tensors(n, param_dtype, state_dtype, generator, specials=i % 2 == 0)
                        for i, n in enumerate(sizes)],
            "index_bases": list(index_bases), "numbers": [3 * i + 1 for i in range(len(sizes))],
            "steps": [1 + i % 5 for i in range(len(sizes))], "misaligns": list(misaligns)}


def _cases():
    cases = []
    pairs = [(p, s) for p in STORAGE for s in STORAGE]
    for index, (p, s) in enumerate(pairs):  # every storage pair, index bases 0-3 mod 4, every alignment
        cases.append(_case(p, s, [0, 1, 5, 1031, 37], [8, 1, 2 + 4 * index, 3, 4 * index + 1],
                           [0, 3, index % 4, 2, 1], seed=index))
    cases.append(_case(torch.bfloat16, torch.bfloat16, [2 * 65536 + 17, 9], [2, 6], [0, 3], seed=20))  # 3 blocks
    cases.append(_case(torch.float16, torch.float32, [1031, 6], [1, 0], [1, 2], stochastic=False, seed=21))
    cases.append(_case(torch.bfloat16, torch.float16, [7, 4], [5, 0], [0, 0], stochastic=False, seed=22))
    cases.append(_case(torch.bfloat16, torch.float32, [1 + i % 13 for i in range(40)],  # > 36 tensors
                       [i * 7 % 29 for i in range(40)], [i % 4 for i in range(40)], seed=23))
    # A table of 3 tensors and 4 blocks of 64: the first tensor needs 5+ blocks, then the table fills
    # up with tensors and restarts, an empty tensor in between.
    cases.append(_case(torch.float16, torch.bfloat16, [300, 5, 70, 1, 0, 129, 64, 257],
                       [3, 0, 1, 2, 0, 7, 4, 254], [1, 0, 2, 3, 0, 1, 0, 2], shape=1, seed=24))
    cases.append(_case(torch.float32, torch.float32, [300, 64, 65, 3], [0, 2, 1, 3], [0, 1, 2, 3], shape=1, seed=25))
    # FSDP2 shards: each buffer at its own alignment (the grad or a moment off its parameter's).
    cases.append(_case(torch.float32, torch.float32, [1031, 70, 9], [3, 1, 0], [(0, 1, 2, 3), (2, 2, 0, 2), (1, 0, 1, 3)],
                       seed=26))
    cases.append(_case(torch.bfloat16, torch.float32, [517, 64], [2, 5], [(1, 3, 0, 2), (0, 0, 3, 0)], seed=27))
    cases.append(_case(torch.float16, torch.float16, [300, 130], [1, 0], [(2, 0, 1, 1), (3, 1, 3, 3)], shape=1, seed=28))
    # maximize, and the other hyper-parameter sets (with and without stochastic rounding)
    cases.append(_case(torch.bfloat16, torch.bfloat16, [1031, 5], [1, 2], [0, 3], seed=29, maximize=True))
    cases.append(_case(torch.float32, torch.float16, [257, 6], [0, 3], [1, (2, 0, 2, 1)], seed=30,
                       hyper=OTHER_HYPERS[0], maximize=True))
    cases.append(_case(torch.float16, torch.bfloat16, [301, 4], [3, 0], [3, 0], seed=31, hyper=OTHER_HYPERS[1]))
    cases.append(_case(torch.float16, torch.float32, [129], [1], [2], stochastic=False, seed=32, hyper=OTHER_HYPERS[0]))
    return cases


def _raw(t):
    return (t.view(torch.int16) if t.dtype != torch.float32 else t).numpy().tobytes()


def _write(cases, folder):
    folder.mkdir(exist_ok=True)
    lines = [str(len(cases))]
    with open(folder / "inputs.bin", "wb") as blob:
        for c in cases:
            h = c["hyper"]
            lines.append(f"{c['shape']} {STORAGE[c['param']]} {STORAGE[c['state']]} {int(c['stochastic'])} {SEED} "
                         f"{OFFSET} {h['lr']!r} {h['beta1']!r} {h['beta2']!r} {h['eps']!r} {h['weight_decay']!r} "
                         f"{int(c['maximize'])} {len(c['tensors'])}")
            for group, base, number, step, misalign in zip(c["tensors"], c["index_bases"], c["numbers"],
                                                            c["steps"], c["misaligns"]):
                lines.append(f"{group[0].numel()} {base} {3 * number} {step} {' '.join(map(str, misalign))}")
                for t in group:
                    blob.write(_raw(t))
    (folder / "cases.txt").write_text("\n".join(lines) + "\n")


def _cpu_step(c):
    groups = [[t.clone() for t in group] for group in c["tensors"]]
    params, grads, exp_avgs, exp_avg_sqs = (list(role) for role in zip(*groups))
    h = c["hyper"]
    torch.ops.clipshard.adamw_step_(params, grads, exp_avgs, exp_avg_sqs, c["steps"], h["lr"], h["beta1"], h["beta2"],
                                    h["eps"], h["weight_decay"], c["maximize"], c["stochastic"], SEED, OFFSET,
                                    c["numbers"], c["index_bases"])
    return groups


def _read_outputs(cases, folder):
    data, at, out = (folder / "outputs.bin").read_bytes(), 0, []
    for c in cases:
        groups = []
        for group in c["tensors"]:
            tensors = []
            for t in group:
                n = t.numel() * t.element_size()
                raw = np.frombuffer(data[at:at + n], dtype=np.int32 if t.dtype == torch.float32 else np.int16)
                tensors.append(torch.from_numpy(raw.copy()))
                at += n
            groups.append(tensors)
        out.append(groups)
    assert at == len(data)
    return out


def _vector_accesses(numel, misaligns):
    """Vector accesses of one tensor: its groups of 4 start at the parameter's vector-aligned addresses;
    in each that lies inside the tensor the param is loaded and stored, the grad loaded and each moment
    loaded and stored as vectors where that buffer shares the parameter's alignment (else scalars)."""
    lead = misaligns[0] % 4
    whole = sum(1 for e in range(-lead, numel, 4) if e >= 0 and e + 4 <= numel)
    same = [m % 4 == lead for m in misaligns]
    return whole * (2 + same[1] + 2 * same[2] + 2 * same[3])


def _run(exe, cases, folder):
    _write(cases, folder)
    run = subprocess.run([str(exe), str(folder)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ALL DONE" in run.stdout, run.stdout + run.stderr
    stats = [line.split() for line in run.stdout.splitlines() if line.startswith("case ")]
    return _read_outputs(cases, folder), [(int(s[3]), int(s[5])) for s in stats]


def _differing_bits(emulated, cases):
    """Per case, the number of stored values whose bits differ from the CPU kernel's."""
    counts = []
    for got_groups, c in zip(emulated, cases):
        want_groups = _cpu_step(c)
        counts.append(sum(int((got != _raw_tensor(want)).sum()) for gg, wg in zip(got_groups, want_groups)
                          for got, want in zip(gg, wg)))
    return counts


def _raw_tensor(t):
    return t.view(torch.int16) if t.dtype != torch.float32 else t.view(torch.int32)


def test_adamw_cuda_kernel_matches_cpu_kernel_bitwise_in_host_emulation(harnesses, tmp_path):
    real, _ = harnesses
    cases = _cases()
    emulated, stats = _run(real, cases, tmp_path / "real")
    assert _differing_bits(emulated, cases) == [0] * len(cases)
    for c, (launches, vector_accesses) in zip(cases, stats):
        want = sum(_vector_accesses(g[0].numel(), m) for g, m in zip(c["tensors"], c["misaligns"]))
        assert vector_accesses == want, (c["index_bases"], c["misaligns"])
    assert stats[12][0] == 2  # 40 tensors: two tables
    assert stats[13][0] >= 4 and stats[14][0] >= 2  # the small table: a long tensor spans several


def test_adamw_emulation_catches_a_kernel_with_one_philox_block_per_group(harnesses, tmp_path):
    _, broken = harnesses
    cases = [c for c in _cases() if c["stochastic"] and c["param"] != torch.float32][:2]
    emulated, _ = _run(broken, cases, tmp_path / "broken")
    assert all(count > 0 for count in _differing_bits(emulated, cases))


def test_adamw_emulation_catches_a_kernel_that_assumes_its_parameters_alignment(tmp_path):
    """A copy whose fp32 loads take the vector path wherever the group is whole (every buffer assumed
    at its parameter's alignment) makes a misaligned vector load on the FSDP2-shard cases, which the
    emulation stops on, as a GPU would fault."""
    folder = broken_copy("adamw_kernels.cuh", tmp_path / "kernel",
                         "if (whole && (reinterpret_cast<uintptr_t>(src + e) & 15u) == 0) {", "if (whole) {")
    finish_builds({"aligned": start_build(HARNESS, tmp_path / "aligned", folder)})
    cases = [c for c in _cases() if c["param"] == torch.float32 and len(set(c["misaligns"][0])) > 1]
    assert cases
    _write(cases, tmp_path / "cases")
    run = subprocess.run([str(tmp_path / "aligned"), str(tmp_path / "cases")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode != 0 and "misaligned 16-byte vector access" in run.stderr, run.stdout + run.stderr
