"""Turns `ptxas -v` output (stdin) into one table row per kernel: registers, spill stores/loads,
stack frame, static shared memory. Used by benchmarks/cuda_resources.sh."""
import re
import subprocess
import sys

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?")


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return [strip_parameters(n) for n in out[:len(names)]]


def strip_parameters(name):
    """`void f<T>(int, float*)` -> `f<T>`: drops the trailing parameter list and the return type."""
    if name.endswith(")"):
        depth = 0
        for k in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[k], 0)
            if depth == 0:
                name = name[:k]
                break
    return name[5:] if name.startswith("void ") else name


def main():
    arch = sys.argv[1] if len(sys.argv) > 1 else ""
    rows, current = [], None
    for line in sys.stdin:
        if m := ENTRY.search(line):
            current = {"name": m.group(1), "arch": m.group(2), "stack": 0, "spill_st": 0, "spill_ld": 0}
            rows.append(current)
        elif current and (m := FRAME.search(line)):
            current["stack"], current["spill_st"], current["spill_ld"] = map(int, m.groups())
        elif current and (m := USED.search(line)):
            current["regs"] = int(m.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(smem.group(1)) if smem else 0
    names = demangle([r["name"] for r in rows])
    print(f"| kernel ({arch}) | registers | spill stores / loads (bytes) | stack (bytes) | static smem (bytes) |")
    print("|---|---|---|---|---|")
    for row, name in sorted(zip(rows, names), key=lambda x: x[1]):
        print(f"| `{name}` | {row.get('regs', '?')} | {row['spill_st']} / {row['spill_ld']} | {row['stack']} | "
              f"{row.get('smem', 0)} |")


if __name__ == "__main__":
    main()
