"""benchmarks/gpu_check.sh where it cannot check anything: without a CUDA device it stops at once
with a message and exit status 2, and a killed run stops with 143; either way its output folder
ends with exactly the summary and the one archive of every log (a lent GPU machine returns few
files). docs/gpu_check.md."""
import os
import pathlib
import signal
import subprocess
import sys
import tarfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _outputs(out):
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check_logs.tar.gz", "summary.txt"]
    with tarfile.open(out / "gpu_check_logs.tar.gz") as archive:
        names = archive.getnames()
        summary = archive.extractfile("logs/summary.txt").read().decode()
    assert summary == (out / "summary.txt").read_text()
    return names, summary


def test_without_a_gpu_it_says_so_and_still_writes_its_archive(tmp_path):
    out = tmp_path / "gpu"
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "torch.cuda.is_available() is false here (torch " in done.stdout and "needs a GPU" in done.stdout
    names, summary = _outputs(out)
    assert "logs/no_gpu.txt" in names
    assert "-- no CUDA device: nothing was checked" in summary and "-- status 2" in summary


def test_a_killed_run_still_writes_its_summary_and_archive(tmp_path):
    slow = tmp_path / "python"  # a "python" that hangs in the first step
    slow.write_text("#!/bin/sh\nexec sleep 60\n")
    slow.chmod(0o755)
    out = tmp_path / "gpu"
    run = subprocess.Popen(["bash", str(SCRIPT), str(out)], env=dict(os.environ, PYTHON=str(slow)),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (out / "logs").is_dir() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    os.killpg(run.pid, signal.SIGTERM)  # as `timeout` or a scheduler ends a job: the whole group
    stdout, _ = run.communicate(timeout=60)
    assert run.returncode == 143, stdout
    _, summary = _outputs(out)
    assert "-- status 143" in summary
