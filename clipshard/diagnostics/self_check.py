"""`python -m clipshard` and `clipshard.self_check()`: the environment report, then every kernel
check of kernel_checks.CHECKS on every visible device (the CPU included), a table of what passed
with the worst error against its tolerance, and exit status 0 only when everything passed
(docs/self_check.md)."""
import argparse
import json
import sys
import time
import traceback

import torch

from clipshard.diagnostics.environment import environment_report, format_environment
from clipshard.diagnostics.kernel_checks import CHECKS, Measurement

FALLBACK = ("A compiled clipshard kernel disagreed with its reference. Until it is fixed, run with "
            "CLIPSHARD_ALGORITHM=torch (the portable PyTorch path for the losses; stochastic rounding and "
            "AdamW have no such fallback: use torch's) and please report this output as an issue.")


def visible_devices():
    return [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def run_checks(devices=None, checks=CHECKS):
    """One row per measurement: {check, device, case, error, tolerance, passed, note}. A check that
    raises gives one failed row with the exception."""
    rows = []
    for device in devices or visible_devices():
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


def self_check(devices=None):
    """The environment report and the kernel checks: a dict with "environment", "results" (the rows
    of run_checks), "passed" (all rows passed) and "seconds"."""
    start = time.perf_counter()
    environment = environment_report()
    results = run_checks(devices)
    return {"environment": environment, "results": results, "passed": all(r["passed"] for r in results),
            "seconds": round(time.perf_counter() - start, 2)}


def format_results(report):
    rows = report["results"]
    width = max(len(f"{r['check']} {r['case']}") for r in rows)
    lines = [f"{'check':<{width}}  {'device':<7} {'worst error':>11}  {'tolerance':>9}  result"]
    for r in rows:
        error = f"{r['error']:.0f} bits" if r["tolerance"] == 0 and r["error"] == r["error"] else f"{r['error']:.2e}"
        result = ("ok" if r["passed"] else "FAILED") + (f"  {r['note']}" if r["note"] else "")
        lines.append(f"{r['check'] + ' ' + r['case']:<{width}}  {r['device']:<7} {error:>11}  {r['tolerance']:>9.2e}  "
                     f"{result}")
    failed = [r for r in rows if not r["passed"]]
    lines.append(f"{len(rows) - len(failed)} of {len(rows)} checks passed in {report['seconds']:.1f} s")
    if failed:
        lines.append("FAILED: " + "; ".join(f"{r['check']} {r['case']} on {r['device']}" for r in failed))
        lines.append(FALLBACK)
    return lines


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
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
