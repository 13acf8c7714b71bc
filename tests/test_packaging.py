"""Packaging (docs/packaging.md): the sdist holds what a build needs, a build that cannot import torch
says what to do, and a library built for another torch release is refused before it is loaded."""
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from clipshard import _build_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import build_support  # noqa: E402


def load_check_dists():
    spec = importlib.util.spec_from_file_location("check_dists", os.path.join(ROOT, ".ci", "check_dists.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sdist_holds_every_tracked_file_the_build_needs_and_nothing_else(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    (tarball,) = tmp_path.glob("clipshard-*.tar.gz")
    problems, counts = load_check_dists().sdist_problems(str(tarball))
    assert not problems, problems
    assert counts["headers"] > 0


def test_a_build_without_torch_says_what_to_do_in_its_first_line():
    """What an isolated build (pip install . without --no-build-isolation) sees: no torch."""
    script = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', 'bdist_wheel']; "
              "runpy.run_path('setup.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    first = done.stderr.splitlines()[0]
    assert first.startswith("clipshard builds against the torch already installed") and "install torch" in first
    assert "Traceback" not in done.stderr


def test_the_isolation_message_names_the_torch_found_and_the_exact_command():
    pip = [sys.executable, "-m", "pip", "install", "dist/clipshard-0.1.0.tar.gz"]
    first = build_support.missing_torch_message(pip).splitlines()[0]
    assert f"torch {importlib.metadata.version('torch')} for {sys.executable}" in first
    assert first.endswith(f"run  {sys.executable} -m pip install --no-build-isolation dist/clipshard-0.1.0.tar.gz")
    assert build_support.without_isolation([sys.executable, "-m", "build"]) == [sys.executable, "-m", "build",
                                                                                "--no-isolation"]
    assert build_support.without_isolation(["uv", "pip", "install", "."]) == ["uv", "pip", "install",
                                                                             "--no-build-isolation", "."]
    assert build_support.without_isolation([sys.executable, "-m", "pytest", "-k", "build"]) is None


def test_the_sdist_needs_no_torch_and_asks_for_the_floor():
    script = ("import runpy, sys; sys.modules['torch'] = None; "
              "sys.argv = ['setup.py', '-q', 'egg_info', '-e', sys.argv[1]]; runpy.run_path('setup.py', run_name='__main__')")
    with_tmp = os.path.join(ROOT, "build", "egg_info_test")
    os.makedirs(with_tmp, exist_ok=True)
    done = subprocess.run([sys.executable, "-c", script, with_tmp], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    requires = open(os.path.join(with_tmp, "clipshard.egg-info", "requires.txt")).read().split("\n\n")[0].split()
    shutil.rmtree(with_tmp)
    assert requires == [build_support.torch_floor().replace(" ", "")]


@pytest.mark.parametrize("from_sdist", [False, True])
def test_a_build_s_metadata_pins_the_running_torch_release_and_labels_it_on_request(tmp_path, from_sdist):
    """From the clone and from the unpacked sdist (whose generated setup.cfg sets egg_info's tag_build)."""
    source = ROOT
    if from_sdist:
        subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT, check=True,
                       capture_output=True, timeout=120)
        (tarball,) = tmp_path.glob("clipshard-*.tar.gz")
        shutil.unpack_archive(tarball, tmp_path)
        (source,) = [p for p in tmp_path.glob("clipshard-*") if p.is_dir()]
    env = {**os.environ, "USE_CUDA": "0", "CLIPSHARD_LOCAL_VERSION": "1"}
    done = subprocess.run([sys.executable, "setup.py", "-q", "dist_info", "-o", str(tmp_path)], cwd=source, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    (metadata,) = tmp_path.glob("clipshard-*.dist-info/METADATA")
    lines = metadata.read_text().splitlines()
    release = _build_record.release(torch.__version__)
    assert f"Version: 0.1.0+torch{release}cpu" in lines
    torch_requirements = [line for line in lines if re.match(r"Requires-Dist: torch\b", line)]
    assert torch_requirements == [f"Requires-Dist: torch=={release}.*"]


@pytest.mark.parametrize("torch_version, expected", [
    ("2.14.1", "torch==2.14.*"), ("2.14.0+cu130", "torch==2.14.*"), ("2.15.0a0+git1234", "torch==2.15.*")])
def test_a_build_pins_the_release_line_it_was_built_on(torch_version, expected):
    assert build_support.torch_requirement(torch_version) == expected


def test_the_local_version_label_names_torch_and_cuda():
    assert build_support.local_label("2.14.1+cu130", "13.0") == "+torch2.14cu130"
    assert build_support.local_label("2.14.1+cpu", None) == "+torch2.14cpu"


@pytest.mark.parametrize("record, torch_version, torch_cuda, refused", [
    ({"torch": "2.14.1+cu130", "cuda": "13.0"}, "2.14.0+cu130", "13.0", None),
    ({"torch": "2.14.1+cu130", "cuda": "none"}, "2.14.1+cpu", None, None),
    ({"torch": "2.14.1+cu130", "cuda": "13.0"}, "2.13.0+cu130", "13.0",
     "built with torch 2.14.1+cu130, and torch 2.13.0"),
    ({"torch": "2.14.1+cu130", "cuda": "13.0"}, "2.15.0", "13.0", "built with torch 2.14.1+cu130, and torch 2.15.0"),
    ({"torch": "2.14.1+cu130", "cuda": "13.0"}, "2.14.1+cpu", None, "CPU-only build"),
    ({"torch": "2.14.1+cu130", "cuda": "13.0"}, "2.14.1+cu128", "12.8", "uses CUDA 12.8"),
    (None, "2.14.1", None, "no record"),
])
def test_a_library_is_refused_beside_another_torch_release(record, torch_version, torch_cuda, refused):
    problem = _build_record.mismatch(record, torch_version, torch_cuda)
    assert (problem is None) if refused is None else (refused in problem)


def test_the_running_library_records_the_running_torch():
    record = _build_record.read_record(_build_record.library_path())
    assert record["torch"] == torch.__version__ and record["cuda"] != ""


def test_a_library_built_with_another_torch_release_is_not_loaded(tmp_path):
    """The compiled library with its recorded torch release changed (as if built on the release before the
    running one): importing clipshard raises an ImportError naming both versions, before loading it."""
    package = tmp_path / "clipshard"
    shutil.copytree(os.path.join(ROOT, "clipshard"), package, ignore=shutil.ignore_patterns("__pycache__"))
    (library,) = package.glob("_C.*.so")
    running = torch.__version__
    major, minor = (int(v) for v in _build_record.release(running).split("."))
    other = f"{major}.{minor - 1 if minor > 0 else minor + 1}"
    data = library.read_bytes()
    recorded = f"torch={running};".encode()
    assert data.count(recorded) == 1
    faked = f"torch={other}{running[len(_build_record.release(running)):]};".encode()
    library.write_bytes(data.replace(recorded, faked))
    script = "import sys, clipshard; print('imported'); print('_C loaded:', 'clipshard._C' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1 and "imported" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: clipshard's compiled library") and str(library) in last
    assert f"built with torch {faked.decode()[6:-1]}, and torch {running} is running" in last
    assert "pip install --no-build-isolation" in last
