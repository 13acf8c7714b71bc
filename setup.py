"""Builds clipshard._C: C++ CPU kernels always, CUDA kernels when a CUDA toolkit and a CUDA build
of torch are present (FORCE_CUDA=1 forces them, USE_CUDA=0 skips them), against the torch already
installed (build_support.py; docs/packaging.md). An sdist needs no torch."""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)  # build_support, beside this file (setuptools' backend does not add it)
import build_support  # noqa: E402
# Used when no GPU is visible at build time (CI, wheels, containers; docs/fused_loss_cuda.md,
# "Build"): SASS for Ampere (sm_80, also run by sm_86/87/89), Hopper (sm_90), datacenter Blackwell
# (sm_100, also sm_103) and consumer Blackwell (sm_120, also sm_121); PTX of compute_120 so that
# GPUs newer than the list JIT the newest code, and PTX of compute_80 for any other arch >= 8.0
# (e.g. sm_110); that PTX costs no compile time (nvcc already generates it for the sm_80 SASS).
# With a visible GPU, torch's own default applies: that GPU's arch plus its PTX.
DEFAULT_ARCHS = "8.0+PTX;9.0;10.0;12.0+PTX"


def _real_toolkit(path):
    return path if path and os.path.isfile(os.path.join(path, "bin", "nvcc")) and \
        os.path.isfile(os.path.join(path, "include", "cuda_runtime.h")) else None


def find_cuda_home():
    """CUDA_HOME/CUDA_PATH if set; else the toolkit behind the nvcc on PATH, following symlinks
    and wrapper scripts (an `exec /opt/cuda/bin/nvcc "$@"` script is common); else /usr/local/cuda*."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if _real_toolkit(os.environ.get(var)):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc:
        nvcc = os.path.realpath(nvcc)
        home = _real_toolkit(os.path.dirname(os.path.dirname(nvcc)))
        if home and open(nvcc, "rb").read(2) != b"#!":
            return home
        if open(nvcc, "rb").read(2) == b"#!":  # a wrapper script: look for the real nvcc it runs
            for target in re.findall(r"(/\S+)/bin/nvcc\b", open(nvcc, errors="replace").read()):
                if _real_toolkit(target):
                    return target
    for home in sorted(glob.glob("/usr/local/cuda*"), reverse=True):
        if _real_toolkit(home):
            return home
    return None


def nvcc_version(cuda_home):
    out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"],
                         capture_output=True, text=True).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else "unknown"


def decide_cuda(torch):
    """Returns (cuda_home or None, reason)."""
    if os.environ.get("USE_CUDA", "1") == "0":
        return None, "USE_CUDA=0"
    force = os.environ.get("FORCE_CUDA", "0") == "1"
    cuda_home = find_cuda_home()
    problem = None
    if torch.version.cuda is None:
        problem = f"torch {torch.__version__} is a CPU-only build"
    elif cuda_home is None:
        problem = "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    if problem and force:
        sys.exit(f"clipshard: FORCE_CUDA=1 but {problem}")
    return (None, problem) if problem else (cuda_home, "FORCE_CUDA=1" if force else "CUDA toolkit found")


def wheel_header_dir(cuda_home, dest):
    """cuBLAS/cuRAND/... headers ship with torch's nvidia wheels when the toolkit lacks them. Returns
    `dest`, a folder of symlinks to just the wheel headers (top-level names) that the toolkit's
    include folder does not have, so a wheel's cuda_runtime.h, cuda_fp16.hpp, ... of another minor
    version can never shadow the toolkit's own. The first wheel to provide a name wins."""
    import site

    toolkit = set(os.listdir(os.path.join(cuda_home, "include")))
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for base in site.getsitepackages() + [site.getusersitepackages()]:
        for include in sorted(glob.glob(os.path.join(base, "nvidia", "*", "include"))):
            for name in sorted(os.listdir(include)):
                if name not in toolkit and not os.path.lexists(os.path.join(dest, name)):
                    os.symlink(os.path.join(include, name), os.path.join(dest, name))
    return dest


def build_extension(torch):
    """Returns (the extension, its build_ext class, the CUDA version of its kernels or None)."""
    cuda_home, reason = decide_cuda(torch)
    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home  # before cpp_extension computes its own guess
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cuda_version = nvcc_version(cuda_home) if cuda_home else None
    record = build_support.write_build_record(os.path.join(ROOT, "build", "build_record"), torch.__version__,
                                              cuda_version)
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/chunked/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # setuptools rebuilds only when a source or one of these is newer than the library; ninja then
    # recompiles just the files that include what changed (its depfiles)
    depends = sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.cuh", recursive=True)) + [record]
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.dirname(record)]
    cxx_flags = ["-O3", "-fopenmp"] if sys.platform != "darwin" else ["-O3"]
    # no debug info (Python's own CFLAGS bring -g): a tenth of the size; CLIPSHARD_DEBUG_INFO=1 keeps it
    debug_info = build_support.build_switch("CLIPSHARD_DEBUG_INFO")
    cxx_flags += [] if debug_info else ["-g0"]
    link_flags = ["-fopenmp"] + ([] if debug_info or sys.platform == "darwin" else ["-Wl,--strip-debug"])
    if cuda_home is None:
        print(f"clipshard: building CPU kernels only ({reason}); torch {torch.__version__}")
        ext = CppExtension("clipshard._C", sources, include_dirs=include_dirs, depends=depends,
                           extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)
        return ext, BuildExtension, None

    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        visible = torch.cuda.is_available() and torch.cuda.device_count() > 0
        if not visible:
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "the visible GPUs")
    print(f"clipshard: building CPU + CUDA kernels for {archs} ({reason}; nvcc "
          f"{cuda_version} at {cuda_home}; torch {torch.__version__})")
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    wheel_headers = wheel_header_dir(cuda_home, os.path.join(ROOT, "build", "wheel_cuda_headers"))
    ext = CUDAExtension(
        "clipshard._C", sources,
        include_dirs=include_dirs + [wheel_headers],
        depends=depends,
        define_macros=[("CLIPSHARD_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags,
                            "nvcc": ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]},
        extra_link_args=link_flags)
    return ext, BuildExtension, cuda_version


def package_options(torch):
    """setup()'s arguments that depend on torch: for an sdist (torch None) only the floor; for a
    build, the extension and the pin on the release line it is built against."""
    version = build_support.package_version()
    if torch is None:
        return {"version": version, "install_requires": [build_support.torch_floor()]}
    ext, build_ext_cls, cuda_version = build_extension(torch)
    if build_support.build_switch("CLIPSHARD_LOCAL_VERSION"):
        version += build_support.local_label(torch.__version__, cuda_version)
    return {"version": version, "install_requires": [build_support.torch_requirement(torch.__version__)],
            "ext_modules": [ext], "cmdclass": {"build_ext": build_ext_cls.with_options(use_ninja=True)}}


setup(
    packages=find_packages(include=["clipshard", "clipshard.*"]),
    **package_options(build_support.import_torch_for(sys.argv)),
)
