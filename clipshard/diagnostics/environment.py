"""The environment report of `python -m clipshard`: versions, how the extension was built (and for
which GPU architectures, read from the library itself), the visible devices, what
algorithm="auto" picks on each device type and why, and the CLIPSHARD_* variables."""
import glob
import os
import platform
import re
import shutil
import site
import subprocess

import torch

import clipshard
from clipshard import _C
from clipshard._build_record import read_record
from clipshard.ops import env_vars, explain_auto, has_compiled_kernel

# How clipshard's readers of the variables (clipshard/ops/env_vars.py, csrc/env_vars.h) word a
# value they do not accept: "the environment variable NAME must be <what is accepted>, got <value>".
_REFUSED_VALUE = re.compile(r"the environment variable (CLIPSHARD_\w+) (must be .*?),? got ")


def variable_problem(message):
    """For the error a CLIPSHARD_* variable's reader raised (its message), a sentence naming the
    variable, its value and what it accepts; None for any other error."""
    found = _REFUSED_VALUE.search(message)
    if found is None:
        return None
    name, accepted = found.groups()
    return (f"the environment variable {name} is set to {os.environ.get(name)!r}, which clipshard does not accept: "
            f"it {accepted}")


def has_cuda_kernels():
    return has_compiled_kernel("clipshard::contrastive_lse_forward", "cuda")


def find_cuobjdump():
    """The nvidia-cuda-cuobjdump wheel's binary, else the CUDA toolkit's (CUDA_HOME, CUDA_PATH, the
    usual folder), else one on PATH; None when there is none."""
    for base in site.getsitepackages() + [site.getusersitepackages()]:
        found = sorted(glob.glob(os.path.join(base, "nvidia", "*", "bin", "cuobjdump")))
        if found:
            return found[0]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "cuobjdump")):
            return os.path.join(home, "bin", "cuobjdump")
    return shutil.which("cuobjdump")


def listed_archs(cuobjdump, flag, library=None):
    """sm numbers of the cubins (--list-elf) or PTX (--list-ptx) in the extension, one per entry."""
    out = subprocess.run([cuobjdump, flag, library or _C.__file__], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"cuobjdump {flag} failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    return [int(m) for m in re.findall(r"\.sm_(\d+)a?\.(?:cubin|ptx)\s*$", out.stdout, re.MULTILINE)]


def build_report():
    """How the extension was built: "CPU only" or "CUDA", the torch and CUDA versions it was built
    with, and for CUDA the architectures of its cubins and PTX (or why they could not be read)."""
    built_with = read_record(_C.__file__)
    if not has_cuda_kernels():
        return {"kind": "CPU only (no CUDA kernels compiled)", "library": _C.__file__, "built_with": built_with}
    report = {"kind": "CUDA", "library": _C.__file__, "built_with": built_with}
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        report["archs"] = "unknown: no cuobjdump here (pip install nvidia-cuda-cuobjdump to list them)"
        return report
    try:
        cubins, ptx = listed_archs(cuobjdump, "--list-elf"), listed_archs(cuobjdump, "--list-ptx")
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
        report["archs"] = f"unknown: {error}"
        return report
    report["cubins"] = [f"sm_{a}" for a in sorted(set(cubins))]
    report["ptx"] = [f"compute_{a}" for a in sorted(set(ptx))]
    return report


def devices():
    """Every visible device: the CPU, then each CUDA (or ROCm) device."""
    found = [{"device": "cpu", "name": platform.processor() or platform.machine(), "arch": platform.machine()}]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            arch = getattr(props, "gcnArchName", None) if torch.version.hip else f"sm_{props.major}{props.minor}"
            found.append({"device": f"cuda:{index}", "name": props.name, "arch": arch,
                          "memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count})
    return found


def auto_choices(device_types):
    """Per device type and op: what algorithm="auto" picks for fp32 inputs (and fp64, when that
    differs) and why."""
    choices = []
    for device_type in device_types:
        for op in ("contrastive_lse", "siglip_sum"):
            for dtype in (torch.float32, torch.float64):
                algorithm, reason, _ = explain_auto(op, device_type, dtype)
                if dtype == torch.float64 and choices and choices[-1]["algorithm"] == algorithm:
                    continue
                choices.append({"device_type": device_type, "op": op, "dtype": str(dtype).removeprefix("torch."),
                                "algorithm": algorithm, "reason": reason})
    return choices


def environment_report():
    """The report's fields; "problems" lists the CLIPSHARD_* variables whose values clipshard refuses:
    every variable of env_vars.VARIABLES is validated, also those this build never reads."""
    visible = devices()
    device_types = ["cpu"] + (["cuda"] if len(visible) > 1 else [])
    problems = [variable_problem(message) for message in env_vars.refusals()]
    try:
        auto = auto_choices(device_types)
    except ValueError as error:  # CLIPSHARD_ALGORITHM refused: already among the problems
        if variable_problem(str(error)) is None:
            raise
        auto = []
    return {
        "clipshard": clipshard.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "rocm": torch.version.hip,
        "python": platform.python_version(),
        "build": build_report(),
        "devices": visible,
        "no_gpu_visible": len(visible) == 1,
        "auto": auto,
        "variables": {name: os.environ.get(name) for name in sorted(set(env_vars.VARIABLES) | {
            n for n in os.environ if n.startswith("CLIPSHARD_")})},
        "problems": problems,
    }


def format_environment(report):
    build = report["build"]
    lines = [f"clipshard {report['clipshard']}, torch {report['torch']} (CUDA {report['cuda']}, "
             f"ROCm {report['rocm']}), Python {report['python']}",
             f"extension: {build['kind']}: {build['library']}",
             f"  built with torch {build['built_with']['torch']}, CUDA {build['built_with']['cuda']}"]
    if "cubins" in build:
        lines.append(f"  compiled for {', '.join(build['cubins']) or 'no cubin'}; PTX {', '.join(build['ptx']) or 'none'}")
    elif "archs" in build:
        lines.append(f"  architectures: {build['archs']}")
    lines.append("devices:")
    for d in report["devices"]:
        extra = f", {d['memory_gib']} GiB, {d['sms']} SMs" if "sms" in d else ""
        lines.append(f"  {d['device']}: {d['name']} ({d['arch']}{extra})")
    if report["no_gpu_visible"]:
        lines.append("  no GPU is visible: only the CPU kernels are checked")
    lines.append('algorithm="auto" picks:' + ("" if report["auto"] else " unknown (see the problems below)"))
    for c in report["auto"]:
        lines.append(f"  {c['device_type']} {c['op']} {c['dtype']}: {c['algorithm']} ({c['reason']})")
    lines.append("environment variables:")
    for name, value in report["variables"].items():
        known = env_vars.VARIABLES.get(name)
        meaning = known.meaning if known else "not a variable clipshard reads"
        lines.append(f"  {name}={value if value is not None else '(unset)'}: {meaning}")
    return lines
