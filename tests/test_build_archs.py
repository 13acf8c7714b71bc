"""Which GPU architectures the built extension serves (docs/fused_loss_cuda.md, "Build").

`cuobjdump --list-elf / --list-ptx` (the nvidia-cuda-cuobjdump wheel, or the toolkit's) lists the
device code inside clipshard/_C*.so: one cubin per CUDA source file and architecture, and the PTX.
Built without a visible GPU (CI, wheels, containers), the extension must hold sm_80, sm_90, sm_100
and sm_120 code for every CUDA source file plus compute_120 PTX, so that every NVIDIA GPU from
Ampere on runs it and newer ones can JIT the PTX. On a machine with a GPU, the build targets that
GPU: the test then checks that the device can run what was built.

A CPU-only build has nothing to inspect and the test skips, except when FORCE_CUDA=1 is set (as CI
sets it): then a build without CUDA code is a failure, never a skip."""
import glob
import os
import shutil
import site
import sys

import pytest
import torch

import clipshard._C
from clipshard.diagnostics.environment import listed_archs  # what `python -m clipshard` reports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED_SASS = {80, 90, 100, 120}  # Ampere, Hopper, datacenter Blackwell, consumer Blackwell
REQUIRED_PTX = 120  # the newest architecture's PTX, for GPUs newer than the list
FORCED = os.environ.get("FORCE_CUDA") == "1"


def has_cuda_kernels():
    return torch._C._dispatch_has_kernel_for_dispatch_key("clipshard::contrastive_lse_forward", "CUDA")


def find_cuobjdump():
    """The nvidia-cuda-cuobjdump wheel's binary, else the toolkit's (as setup.py finds it), else PATH."""
    for base in site.getsitepackages() + [site.getusersitepackages()]:
        found = sorted(glob.glob(os.path.join(base, "nvidia", "*", "bin", "cuobjdump")))
        if found:
            return found[0]
    sys.path.insert(0, ROOT)
    try:
        namespace = {"__file__": os.path.join(ROOT, "setup.py")}
        source = open(os.path.join(ROOT, "setup.py")).read().split("def decide_cuda")[0]
        exec(compile(source, "setup.py", "exec"), namespace)  # the toolkit search only, not setup()
        home = namespace["find_cuda_home"]()
    finally:
        sys.path.pop(0)
    if home and os.path.isfile(os.path.join(home, "bin", "cuobjdump")):
        return os.path.join(home, "bin", "cuobjdump")
    return shutil.which("cuobjdump")


def skip_or_fail(reason):
    if FORCED:
        pytest.fail(f"FORCE_CUDA=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def device_code():
    if not has_cuda_kernels():
        skip_or_fail("the extension was built without CUDA kernels")
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        skip_or_fail("no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    return listed_archs(cuobjdump, "--list-elf"), listed_archs(cuobjdump, "--list-ptx")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a build on a GPU machine targets that GPU")
def test_build_without_gpu_serves_every_architecture(device_code):
    cubins, ptx = device_code
    missing = REQUIRED_SASS - set(cubins)
    assert not missing, f"no SASS for sm_{sorted(missing)} in {clipshard._C.__file__} (has {sorted(set(cubins))})"
    # Every CUDA source file is compiled for every architecture: equal counts.
    counts = {arch: cubins.count(arch) for arch in sorted(set(cubins))}
    assert len(set(counts.values())) == 1, f"cubins per architecture differ: {counts}"
    assert REQUIRED_PTX in ptx, f"no compute_{REQUIRED_PTX} PTX (has {sorted(set(ptx))}): newer GPUs could not JIT"
    assert ptx.count(REQUIRED_PTX) == counts[80], "some CUDA source files lack the PTX"


@pytest.mark.cuda
def test_build_runs_on_the_visible_gpu(device_code):
    """The driver runs a cubin of the same major and a minor <= the device's, or JITs PTX <= it."""
    cubins, ptx = device_code
    major, minor = torch.cuda.get_device_capability()
    sm = 10 * major + minor
    runnable = [a for a in cubins if a // 10 == major and a <= sm] + [a for a in ptx if a <= sm]
    assert runnable, f"nothing in the extension runs on sm_{sm}: cubins {sorted(set(cubins))}, PTX {sorted(set(ptx))}"
    assert ptx, "no PTX in the extension"
