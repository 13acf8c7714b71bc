"""Turns `ptxas -v` output (a build log or benchmarks/cuda_resources.sh's logs, any number of
architectures) into one markdown table: per kernel variant and architecture the registers, the
spill stores / loads, and the CTAs per SM that its registers and static shared memory allow.

Usage: python benchmarks/ptxas_table.py [--check] [--title TEXT] [LOG ...]   (stdin without LOG)
--check: exit 1, naming the kernels, if any kernel spills (bytes of spill stores or loads > 0);
CI's build and benchmarks/gpu_check.sh use it (docs/fused_loss_cuda.md, "Resources per kernel").
"""
import argparse
import re
import subprocess
import sys

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")
SMEM = re.compile(r"(\d+) bytes smem")

# Per architecture: registers per SM, resident threads per SM, resident CTAs per SM, shared memory
# per SM that CTAs may use (bytes), and the shared memory the runtime reserves per CTA (CUDA C
# programming guide, "Compute capabilities"). All four have 64 K registers per SM.
ARCHS = {
    "sm_80": (65536, 2048, 32, 164 * 1024, 1024),
    "sm_90": (65536, 2048, 32, 228 * 1024, 1024),
    "sm_100": (65536, 2048, 32, 228 * 1024, 1024),
    "sm_120": (65536, 1536, 32, 100 * 1024, 1024),
}
# Threads per CTA of the kernels that do not launch 256 (their launch sites in csrc/cuda).
THREADS = {"adamw_kernel": 512, "lse_forward_mma_kernel": 128, "lse_backward_mma_kernel": 128}


def threads_of(name):
    return next((n for key, n in THREADS.items() if f"::{key}<" in name or name.endswith(f"::{key}")), 256)


def ctas_per_sm(arch, registers, smem, threads):
    """Resident CTAs per SM: registers are allocated per warp in units of 256 (8 per thread)."""
    regs_per_sm, threads_per_sm, max_ctas, smem_per_sm, smem_reserved = ARCHS[arch]
    warps = (threads + 31) // 32
    regs_per_warp = (max(registers, 1) * 32 + 255) // 256 * 256
    by_registers = (regs_per_sm // regs_per_warp) // warps
    by_threads = threads_per_sm // (warps * 32)
    by_smem = smem_per_sm // (smem + smem_reserved)
    return min(by_registers, by_threads, by_smem, max_ctas)


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return [short_name(n) for n in out[:len(names)]]


def short_name(name):
    """`void clipshard::ns::f<T>(int, float*)` -> `ns::f<T>`: drops the parameter list, the return
    type and the project's namespace."""
    if name.endswith(")"):
        depth = 0
        for k in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[k], 0)
            if depth == 0:
                name = name[:k]
                break
    name = name[5:] if name.startswith("void ") else name
    name = name.replace("clipshard::", "").replace("(anonymous namespace)::", "").replace("c10::", "")
    return re.sub(r"\(Storage\)(\d)", r"\1", name)


def parse(lines):
    """{(mangled name, arch): {regs, smem, stack, spill_st, spill_ld}} over every log line."""
    kernels, current = {}, None
    for line in lines:
        if m := ENTRY.search(line):
            current = kernels.setdefault((m.group(1), m.group(2)), {"regs": 0, "smem": 0, "stack": 0,
                                                                     "spill_st": 0, "spill_ld": 0})
        elif current is not None and (m := FRAME.search(line)):
            current["stack"], current["spill_st"], current["spill_ld"] = map(int, m.groups())
        elif current is not None and (m := USED.search(line)):
            current["regs"] = int(m.group(1))
            smem = SMEM.search(line)
            current["smem"] = int(smem.group(1)) if smem else 0
            current = None
    return kernels


def table(kernels):
    archs = sorted({arch for _, arch in kernels}, key=lambda a: int(a[3:]))
    mangled = sorted({name for name, _ in kernels})
    names = dict(zip(mangled, demangle(mangled)))
    lines = ["| kernel | threads | static smem (B) | " + " | ".join(archs) + " |",
             "|---|---|---|" + "---|" * len(archs)]
    for name in sorted(mangled, key=lambda n: names[n]):
        cells, smem = [], 0
        for arch in archs:
            k = kernels.get((name, arch))
            if k is None:
                cells.append("-")
                continue
            smem = max(smem, k["smem"])
            cell = f"{k['regs']} r, {ctas_per_sm(arch, k['regs'], k['smem'], threads_of(names[name]))} CTA"
            if k["spill_st"] or k["spill_ld"]:
                cell += f", **spill {k['spill_st']} / {k['spill_ld']} B**"
            elif k["stack"]:
                cell += f", stack {k['stack']} B"
            cells.append(cell)
        lines.append(f"| `{names[name]}` | {threads_of(names[name])} | {smem} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="*")
    parser.add_argument("--check", action="store_true", help="exit 1 if any kernel spills")
    parser.add_argument("--title", default="", help="a line printed above the table")
    args = parser.parse_args()
    lines = []
    for path in args.logs or ["-"]:
        lines += (sys.stdin if path == "-" else open(path, errors="replace")).read().splitlines()
    kernels = parse(lines)
    if not kernels:
        sys.exit("ptxas_table: no `ptxas -v` output found (compile with -Xptxas -v)")
    if args.title:
        print(args.title + "\n")
    print(table(kernels))
    spills = [(n, arch) for (n, arch), k in kernels.items() if k["spill_st"] or k["spill_ld"]]
    spilling = sorted(f"{name} ({arch})" for name, (_, arch) in zip(demangle([n for n, _ in spills]), spills))
    if args.check:
        if spilling:
            sys.exit(f"ptxas_table: {len(spilling)} kernel(s) spill registers: " + ", ".join(spilling))
        print(f"\nptxas_table: no spills in {len(kernels)} kernel compilations "
              f"({', '.join(sorted({a for _, a in kernels}, key=lambda a: int(a[3:])))})")


if __name__ == "__main__":
    main()
