"""Every CLIPSHARD_* environment variable clipshard reads, with the values it accepts, and the one
parser that reads them in Python. The extension's C++ readers (csrc/env_vars.h) take the same
spellings: any case, unset or empty means the default, any other value is a ValueError that names
the variable. docs/self_check.md lists the same variables with the same values (a test compares
them, and the accepted values of the C++ readers, with VARIABLES).

`python -m clipshard` validates every variable here on every build, also those a build never reads
(CLIPSHARD_CHUNKED_FORWARD_ROWS on a CPU-only build), so a misspelt value is reported before it can
matter. The build-time switches (CLIPSHARD_LOCAL_VERSION, CLIPSHARD_DEBUG_INFO) are read by setup.py
through this same parser: it loads this file by its path, so it imports nothing but the standard
library."""
import os
from dataclasses import dataclass

SWITCH = ("1", "true", "on", "yes", "0", "false", "off", "no")  # the first four mean on


@dataclass(frozen=True)
class Variable:
    accepted: tuple  # the accepted values, lower case (any case is accepted)
    meaning: str     # one line for the self-check's report


VARIABLES = {
    "CLIPSHARD_ALGORITHM": Variable(("auto", "torch"),
                                    "'torch' makes every algorithm='auto' run the portable torch path"),
    "CLIPSHARD_CHUNKED_FORWARD_ROWS": Variable(("16", "32"),
                                               "rows per CTA of the CUDA chunked forward kernel (16 or 32)"),
    "CLIPSHARD_ADDMM_FP32_ACCUMULATOR": Variable(
        SWITCH, "'0' makes the chunked backward of 16-bit features use an fp32 buffer"),
    "CLIPSHARD_CPU_ISA": Variable(("avx512", "avx2", "baseline"),
                                  "avx512, avx2 or baseline: the widest vector code the CPU kernels may use"),
    "CLIPSHARD_FIRST_USE_CHECK": Variable(
        SWITCH, "'0' turns off the first-use check of the compiled CUDA kernels (docs/first_use.md)"),
    # read by the build (setup.py loads this file by its path), not by the installed package
    "CLIPSHARD_LOCAL_VERSION": Variable(SWITCH, "build time: '1' adds +torch<release><cuda> to the built version"),
    "CLIPSHARD_DEBUG_INFO": Variable(SWITCH, "build time: '1' keeps debug info in the compiled library"),
}


def refusal(name):
    """The error message for the value of `name` when clipshard does not accept it, else None."""
    raw = os.environ.get(name, "")
    accepted = VARIABLES[name].accepted
    if raw == "" or raw.lower() in accepted:
        return None
    return f"clipshard: the environment variable {name} must be one of {', '.join(accepted)} (or unset), got {raw!r}"


def value(name):
    """The value of `name` (a key of VARIABLES) in lower case, None when unset or empty; a value the
    variable does not accept raises ValueError naming it."""
    message = refusal(name)
    if message is not None:
        raise ValueError(message)
    raw = os.environ.get(name, "")
    return raw.lower() if raw else None


def flag(name, default):
    """The switch `name`: True, False, or `default` when it is not set."""
    assert VARIABLES[name].accepted == SWITCH, f"{name} is not an on/off switch"
    found = value(name)
    return default if found is None else SWITCH.index(found) < 4


def refusals():
    """The messages of every variable in VARIABLES whose value is refused (what the self-check reports)."""
    return [m for m in (refusal(name) for name in VARIABLES) if m is not None]
