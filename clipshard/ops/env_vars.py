"""clipshard's on/off environment switches (CLIPSHARD_*), with the spellings of the extension's own
parser (csrc/env_vars.h): 1, true, on, yes / 0, false, off, no in any case; unset or empty means
the default; any other value is an error that names the variable."""
import os

_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def flag(name, default):
    """The switch `name` (a CLIPSHARD_* variable): True, False, or `default` when it is not set."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value.lower() in _ON:
        return True
    if value.lower() in _OFF:
        return False
    raise ValueError(f"clipshard: the environment variable {name} must be one of {', '.join(_ON + _OFF)} "
                     f"(or unset), got {value!r}")
