"""Building the host emulations of the CUDA kernels (tests/cuda_emulation), and the deliberately
broken kernel copies that show each emulation test can fail."""
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
HARNESSES = ROOT / "tests" / "cuda_emulation"
KERNELS = ROOT / "csrc" / "cuda"
INCLUDE = ROOT / "csrc" / "include"


def start_build(source, exe, kernel_dir=None):
    """Starts compiling harness `source` into `exe` (a Popen: builds run side by side); headers in
    `kernel_dir` take the place of csrc/cuda's."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip("no C++ compiler (set CXX)")
    includes = ([f"-I{kernel_dir}"] if kernel_dir else []) + [
        f"-I{KERNELS}", f"-I{INCLUDE}", f"-I{HARNESSES}",
        f"-I{pathlib.Path(torch.__file__).parent / 'include'}"]
    return subprocess.Popen([compiler, "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", *includes,
                             str(source), "-o", str(exe)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_builds(builds):
    for name, build in builds.items():
        log = build.communicate(timeout=900)[0]
        assert build.returncode == 0, f"{name} emulation build failed:\n{log[-4000:]}"


def broken_copy(kernel, folder, right, wrong, kernels=KERNELS):
    """Writes `kernels`/`kernel` (csrc/cuda's by default) into `folder` with the text `right` replaced
    by `wrong`; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    source = (kernels / kernel).read_text()
    assert source.count(right) == 1, f"{right!r} not found once in {kernel}"
    (folder / kernel).write_text(source.replace(right, wrong))
    if kernels == KERNELS:
        with_launch_headers(folder)
    return folder


def with_launch_headers(folder):
    """Copies csrc/cuda's launch headers (*_launch.h) into `folder` unless it has its own: a launch
    header includes its kernels from its own folder, so only a copy beside a broken kernel includes it."""
    for header in KERNELS.glob("*_launch.h"):
        if not (folder / header.name).exists():
            (folder / header.name).write_text(header.read_text())


def build_real_and_broken(tmp, source, kernel, right, wrong):
    """(real exe, broken exe): the harness compiled against the kernel and against a broken copy."""
    broken = broken_copy(kernel, tmp / "broken_kernel", right, wrong)
    builds = {"real": start_build(source, tmp / "real"), "broken": start_build(source, tmp / "broken", broken)}
    finish_builds(builds)
    return tmp / "real", tmp / "broken"
