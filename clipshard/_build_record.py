"""Before clipshard loads its compiled library (clipshard._C): was it built for the torch running?

The library links torch's C++ API, which torch keeps stable only within a release (2.14.x): beside
another release it may import and then crash in its first call. The build compiles the torch and
CUDA versions it used into the library as one string (csrc/build_record.cpp); this module reads that
string from the file, without loading it, and refuses a library built for another torch release,
naming both versions and the command that rebuilds it (docs/packaging.md).
"""
import importlib.util
import mmap
import os
import re

# The start of the string csrc/build_record.cpp holds (the same in build_support.py).
RECORD_MARKER = b"clipshard-build-record:"


def library_path():
    """The compiled library's file, found without loading it; None when there is none."""
    spec = importlib.util.find_spec("clipshard._C")
    return spec.origin if spec is not None else None


def read_record(path):
    """{"torch": ..., "cuda": ...} as compiled into the library at `path`; None when it has no record."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = data.find(RECORD_MARKER)
        if start < 0:
            return None
        end = data.find(b"\0", start)
        text = data[start + len(RECORD_MARKER):end].decode("ascii", errors="replace")
    return dict(item.split("=", 1) for item in text.split(";") if "=" in item)


def release(version):
    """"2.14" for "2.14.1+cu130"; None for a version without major.minor."""
    found = re.match(r"(\d+)\.(\d+)", version or "")
    return f"{found[1]}.{found[2]}" if found else None


def mismatch(record, torch_version, torch_cuda):
    """Why a library with `record` cannot run beside torch `torch_version` (CUDA `torch_cuda`, None for a
    CPU-only torch), or None when it can."""
    if record is None:
        return "it holds no record of the torch it was built with (built before clipshard recorded it)"
    built_torch, built_cuda = record.get("torch"), record.get("cuda", "none")
    if release(built_torch) is None or release(built_torch) != release(torch_version):
        return f"it was built with torch {built_torch}, and torch {torch_version} is running"
    if built_cuda != "none" and torch_cuda is None:
        return f"it was built with CUDA {built_cuda} kernels, and the running torch {torch_version} is a CPU-only build"
    if re.match(r"\d+\.", built_cuda) and built_cuda.split(".")[0] != torch_cuda.split(".")[0]:
        return (f"its CUDA kernels were built with CUDA {built_cuda}, and the running torch {torch_version} uses "
                f"CUDA {torch_cuda}")
    return None


def rebuild_command(path):
    """The command that rebuilds the library against the running torch: from the clone it was built
    in, or from clipshard's sdist."""
    clone = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if os.path.isfile(os.path.join(clone, "setup.py")) and os.path.isdir(os.path.join(clone, "csrc")):
        return f"pip install --no-build-isolation --no-deps -e {clone}"
    return "pip install --no-build-isolation --no-binary clipshard --force-reinstall --no-deps clipshard"


def check_library():
    """Raises ImportError, before anything loads clipshard._C, when the library was built for another
    torch release (or another CUDA major version) than the running one."""
    import torch

    path = library_path()
    if path is None:
        return  # no compiled library: importing clipshard._C raises its own ImportError
    record = read_record(path)
    problem = mismatch(record, torch.__version__, torch.version.cuda)
    if problem is not None:
        built = release((record or {}).get("torch"))
        raise ImportError(
            f"clipshard's compiled library {path} cannot be loaded: {problem}. torch's C++ API changes between "
            f"releases, so it could crash. Rebuild it against the running torch with  {rebuild_command(path)}  "
            f"(torch must be installed first)" + (f", or install torch=={built}.*" if built else "") + ".")
