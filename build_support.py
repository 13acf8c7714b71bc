"""setup.py's helpers about the torch that clipshard builds against (docs/packaging.md).

The compiled library links torch's C++ API, which torch keeps stable only within a release (2.14.x),
so the build uses the torch already installed and says so everywhere: an import of it that explains
what to do when build isolation hides it, the Requires-Dist pin on its release line, the versions
compiled into the library (clipshard/_build_record.py reads them back before loading it) and the
optional local version label of a wheel (CLIPSHARD_LOCAL_VERSION=1).
"""
import importlib.util
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
# The setup.py commands that compile the library or write a wheel's metadata (with its torch pin);
# an sdist (and the egg_info that pip and build run first, for either) needs no torch.
COMMANDS_NEEDING_TORCH = {"build", "build_ext", "bdist_wheel", "dist_info", "editable_wheel", "develop",
                          "install", "bdist_egg"}
# Starts the string setup.py compiles into the library (csrc/build_record.cpp); read back by
# clipshard/_build_record.py, which holds the same marker.
RECORD_MARKER = "clipshard-build-record:"


def build_switch(name):
    """The build-time switch `name` (CLIPSHARD_LOCAL_VERSION, CLIPSHARD_DEBUG_INFO), off when unset, read
    by the package's one parser of CLIPSHARD_* variables (clipshard/ops/env_vars.py, loaded by its path:
    the package itself needs torch), so that a value it does not accept stops the build naming it."""
    spec = importlib.util.spec_from_file_location("clipshard_env_vars", os.path.join(ROOT, "clipshard", "ops",
                                                                                    "env_vars.py"))
    env_vars = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(env_vars)
    try:
        return env_vars.flag(name, False)
    except ValueError as error:
        sys.exit(str(error))


def torch_floor():
    """The oldest torch the sources build against, "torch>=X.Y", from pyproject.toml's [tool.clipshard]
    (tests/test_build_torch_floor.py keeps it right); the sdist's requirement."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        return re.search(r'torch-floor\s*=\s*"(torch\s*>=\s*[\d.]+)"', f.read()).group(1)


def package_version():
    """clipshard.__version__, read from the file (the one version source)."""
    with open(os.path.join(ROOT, "clipshard", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.MULTILINE).group(1)


def torch_release(version):
    """"2.14" for "2.14.1+cu130": the release line whose C++ API a build is tied to."""
    return ".".join(re.match(r"(\d+)\.(\d+)", version).groups())


def torch_requirement(torch_version):
    """A built library's Requires-Dist: the release line it was built on (torch==2.14.*)."""
    return f"torch=={torch_release(torch_version)}.*"


def local_label(torch_version, cuda_version):
    """The local version label CLIPSHARD_LOCAL_VERSION=1 adds to a wheel: "+torch2.14cu130" (CUDA
    kernels from nvcc 13.0) or "+torch2.14cpu", so wheels for several torch releases can sit side by
    side in one wheelhouse. Off by default: pip refuses an sdist from an index whose built metadata
    says another version than its file name."""
    kind = f"cu{cuda_version.replace('.', '')}" if cuda_version else "cpu"
    return f"+torch{torch_release(torch_version)}{kind}"


def write_build_record(folder, torch_version, cuda_version):
    """Writes folder/clipshard_build_record.h, the versions csrc/build_record.cpp compiles in, only when
    they changed (ninja's header tracking then recompiles that one file). Returns the header's path."""
    text = (f'#define CLIPSHARD_BUILD_RECORD "{RECORD_MARKER}torch={torch_version};'
            f'cuda={cuda_version or "none"};"\n')
    path = os.path.join(folder, "clipshard_build_record.h")
    os.makedirs(folder, exist_ok=True)
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)
    return path


def import_torch_for(argv):
    """torch for the commands that compile or pin (COMMANDS_NEEDING_TORCH), None for the others (an
    sdist); exits with what to do when torch cannot be imported."""
    if not COMMANDS_NEEDING_TORCH & set(argv[1:]):
        return None
    try:
        import torch
    except ImportError:
        sys.exit(missing_torch_message(starting_command()))
    return torch


def starting_command():
    """The command line of the process that ran this build (pip, build, uv; Linux only), or None."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [arg.decode(errors="replace") for arg in f.read().split(b"\0") if arg]
    except OSError:
        return None


def installed_torch(python):
    """The torch version installed for `python` outside any build isolation, or None."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    try:
        done = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                              capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def without_isolation(command):
    """`command` (pip / uv pip install, wheel or download; python -m build) with build isolation turned off,
    None for any other command."""
    programs = [os.path.basename(arg) for arg in command[:3]]
    if any(program.startswith("pip") for program in programs):
        for i, arg in enumerate(command):
            if arg in ("install", "wheel", "download"):
                return command[:i + 1] + ["--no-build-isolation"] + command[i + 1:]
    if command[1:3] == ["-m", "build"] or "pyproject-build" in programs[:2]:
        return command + ["--no-isolation"]
    return None


def missing_torch_message(command):
    """The error of a build that cannot import torch, what to do in its first line."""
    fixed = without_isolation(command) if command else None
    python = command[0] if command and os.path.basename(command[0]).startswith("python") else None
    torch_version = installed_torch(python) if python and fixed else None
    why = ("(clipshard's compiled library is tied to the torch release it is built against, so it builds against "
           "the torch already installed; build isolation would bring a second torch, and a library built against "
           "that one crashes beside yours. README.md, Install)")
    if torch_version:
        return (f"clipshard builds against the torch already installed (torch {torch_version} for {python}), which "
                f"build isolation hides: run  {shlex.join(fixed)}\n{why}")
    if fixed and python:
        return (f"clipshard builds against the torch already installed, and {python} has none: install torch "
                f"first, then run  {shlex.join(fixed)}\n{why}")
    if fixed:
        return (f"clipshard builds against the torch already installed, which build isolation hides: run  "
                f"{shlex.join(fixed)}  (after installing torch, if it is not)\n{why}")
    return ("clipshard builds against the torch already installed, and none can be imported: install torch first "
            f"(then, with pip: pip install --no-build-isolation <clipshard's folder or sdist>)\n{why}")
