"""`python -m clipshard` and `clipshard.self_check()`: the environment report, then every kernel
check of kernel_checks.CHECKS on every visible device (the CPU included), a table of what passed
with the worst error against its tolerance, and the exit status (docs/self_check.md): 0 when every
check ran and passed, 1 when a kernel check failed, 2 when the checks could not run as asked (a
CLIPSHARD_* variable with a value clipshard does not accept, or nothing checked)."""
import argparse
import json
import sys
import time
import traceback

import torch

from clipshard.diagnostics.environment import environment_report, format_environment, variable_problem
from clipshard.diagnostics.kernel_checks import CHECKS, Measurement

FALLBACK = ("A compiled clipshard kernel failed its check (against the portable torch path, the CPU kernel or a "
            "known answer). Until it is fixed, run with "
            "CLIPSHARD_ALGORITHM=torch (the portable PyTorch path for the losses; stochastic rounding and "
            "AdamW have no such fallback: use torch's) and please report this output as an issue.")
FIX_THE_VARIABLE = "Unset the variable or give it an accepted value, then run `python -m clipshard` again."


def visible_devices():
    return [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def _devices(devices):
    """self_check's `devices` as a list of torch.device that a check runs on (None: every visible one)."""
    if devices is None:
        return visible_devices()
    try:
        devices = [torch.device(d) for d in devices]
    except (TypeError, RuntimeError) as error:
        raise TypeError(f"self_check: devices must be a list of torch.device or device names ('cpu', 'cuda:0'), "
                        f"got {devices!r}") from error
    if not devices:
        raise ValueError("self_check: devices is empty, and checking nothing is not a pass; pass None for every "
                         "visible device")
    covered = sorted({t for check in CHECKS for t in check.device_types})
    for device in devices:
        if device.type not in covered:
            raise ValueError(f"self_check: no kernel check runs on {device.type} devices (devices has {device}), and "
                             f"checking nothing is not a pass; the checks run on {' and '.join(covered)} devices")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"self_check: devices has {device}, but {torch.cuda.device_count()} CUDA devices are "
                             "visible")
    return devices


def run_checks(devices=None, checks=CHECKS):
    """One row per measurement: {check, device, case, error, tolerance, passed, note}. A check that
    raises gives one failed row with the exception."""
    rows = []
    for device in visible_devices() if devices is None else devices:
        for check in checks:
            if device.type not in check.device_types:
                continue
            try:
                measurements = list(check.run(device))
            except Exception as error:  # a crashing kernel is a failed check, not a crashed report
                last = traceback.format_exception_only(type(error), error)[-1].strip()
                measurements = [Measurement("raised", float("nan"), 0.0, last)]
            rows += [{"check": check.name, "device": str(device), "case": m.case, "error": float(m.error),
                      "tolerance": float(m.tolerance), "passed": m.passed, "note": m.note} for m in measurements]
    return rows


def _problems(environment, results):
    """Why the checks could not run as asked: refused CLIPSHARD_* values (met by the report or by a
    check that raised), or no check at all."""
    problems = list(environment["problems"])
    for row in results:
        problem = None if row["passed"] else variable_problem(row["note"])
        if problem is not None and problem not in problems:
            problems.append(problem)
    if not results:
        problems.append("no kernel check ran")
    return problems


def self_check(devices=None):
    """The environment report and the kernel checks on `devices` (a list of torch.device; None:
    every visible device; a device no check runs on raises ValueError). Returns a dict with
    "environment", "results" (the rows of run_checks), "problems" (why the checks could not run as
    asked), "passed" (every check ran and passed) and "seconds"."""
    start = time.perf_counter()
    devices = _devices(devices)
    environment = environment_report()
    results = run_checks(devices)
    problems = _problems(environment, results)
    return {"environment": environment, "results": results, "problems": problems,
            "passed": not problems and all(r["passed"] for r in results),
            "seconds": round(time.perf_counter() - start, 2)}


def _blocked_by_a_variable(row):
    return not row["passed"] and variable_problem(row["note"]) is not None


def format_results(report):
    rows = report["results"]
    width = max([len(f"{r['check']} {r['case']}") for r in rows] + [len("check")])
    lines = [f"{'check':<{width}}  {'device':<7} {'worst error':>11}  {'tolerance':>9}  result"]
    for r in rows:
        error = f"{r['error']:.0f} bits" if r["tolerance"] == 0 and r["error"] == r["error"] else f"{r['error']:.2e}"
        result = ("ok" if r["passed"] else "FAILED") + (f"  {r['note']}" if r["note"] else "")
        lines.append(f"{r['check'] + ' ' + r['case']:<{width}}  {r['device']:<7} {error:>11}  {r['tolerance']:>9.2e}  "
                     f"{result}")
    failed = [r for r in rows if not r["passed"] and not _blocked_by_a_variable(r)]
    blocked = [r for r in rows if _blocked_by_a_variable(r)]
    lines.append(f"{sum(r['passed'] for r in rows)} of {len(rows)} checks passed in {report['seconds']:.1f} s")
    if failed:
        lines.append("FAILED: " + "; ".join(f"{r['check']} {r['case']} on {r['device']}" for r in failed))
        lines.append(FALLBACK)
    for problem in report["problems"]:
        lines.append(f"PROBLEM: {problem}")
    if blocked:
        lines.append("Could not run: " + "; ".join(f"{r['check']} on {r['device']}" for r in blocked))
    if any(p.startswith("the environment variable ") for p in report["problems"]):
        lines.append(FIX_THE_VARIABLE)
    return lines


def exit_status(report):
    """0: every check ran and passed; 2: the checks could not run as asked; 1: a kernel check failed."""
    return 0 if report["passed"] else 2 if report["problems"] else 1


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m clipshard",
                                     description="clipshard's environment report and kernel self-check")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args(argv)
    report = self_check()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(format_environment(report["environment"]) + [""] + format_results(report)))
    return exit_status(report)


if __name__ == "__main__":
    sys.exit(main())
