"""benchmarks/ptxas_table.py, which turns ptxas' figures in a build log into the per-architecture
table of docs/fused_loss_cuda.md and, with --check, fails CI's build step on a register spill."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "ptxas_table.py"

# ptxas -v output as nvcc 13.0 prints it (two kernels, two architectures; ninja interleaves other lines).
LOG = """[3/9] /usr/local/cuda/bin/nvcc ... -c csrc/cuda/distill_lse.cu
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN9clipshard12distill_cuda19distill_grad_kernelIffEEvNS0_10GradParamsIT_T0_EE' for 'sm_90'
ptxas info    : Function properties for _ZN9clipshard12distill_cuda19distill_grad_kernelIffEEvNS0_10GradParamsIT_T0_EE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 0 barriers
ptxas info    : Compiling entry function '_ZN9clipshard12distill_cuda22distill_forward_kernelILi2EEEvNS0_13ForwardParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN9clipshard12distill_cuda22distill_forward_kernelILi2EEEvNS0_13ForwardParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 36864 bytes smem
ptxas info    : Compiling entry function '_ZN9clipshard12distill_cuda19distill_grad_kernelIffEEvNS0_10GradParamsIT_T0_EE' for 'sm_120'
ptxas info    : Function properties for _ZN9clipshard12distill_cuda19distill_grad_kernelIffEEvNS0_10GradParamsIT_T0_EE
    40 bytes stack frame, 64 bytes spill stores, 84 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 40 bytes cumulative stack size
ptxas info    : Compiling entry function '_ZN9clipshard12distill_cuda22distill_forward_kernelILi2EEEvNS0_13ForwardParamsE' for 'sm_120'
ptxas info    : Function properties for _ZN9clipshard12distill_cuda22distill_forward_kernelILi2EEEvNS0_13ForwardParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 72 registers, used 1 barriers, 36864 bytes smem
"""


def run(tmp_path, log, *args):
    path = tmp_path / "build.log"
    path.write_text(log)
    return subprocess.run([sys.executable, str(SCRIPT), *args, str(path)], capture_output=True, text=True, timeout=60)


def test_table_rows_carry_registers_and_ctas_per_sm_per_architecture(tmp_path):
    done = run(tmp_path, LOG)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "| kernel | threads | static smem (B) | sm_90 | sm_120 |"
    # 128 registers x 256 threads: two CTAs in 64 K registers; 40 on sm_120: six (its 1536 threads per SM)
    assert "| `distill_cuda::distill_grad_kernel<float, float>` | 256 | 0 | 128 r, 2 CTA | " \
           "40 r, 6 CTA, **spill 64 / 84 B** |" in lines
    # 255 registers: one CTA; 72 registers would fit three, but 36 KiB of shared memory (+1 KiB
    # reserved) fit two in sm_120's 100 KiB
    assert "| `distill_cuda::distill_forward_kernel<2>` | 256 | 36864 | 255 r, 1 CTA | 72 r, 2 CTA |" in lines


def test_check_fails_on_a_spill_and_names_the_kernel(tmp_path):
    done = run(tmp_path, LOG, "--check")
    assert done.returncode == 1
    assert "1 kernel(s) spill registers: distill_cuda::distill_grad_kernel<float, float> (sm_120)" in done.stderr


def test_check_passes_without_spills(tmp_path):
    clean = LOG.replace("40 bytes stack frame, 64 bytes spill stores, 84 bytes spill loads",
                        "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
    done = run(tmp_path, clean, "--check")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "ptxas_table: no spills in 4 kernel compilations (sm_90, sm_120)"


def test_a_log_without_ptxas_figures_is_an_error(tmp_path):
    done = run(tmp_path, "[1/1] c++ -c csrc/clipshard.cpp\n", "--check")
    assert done.returncode != 0 and "no `ptxas -v` output found" in done.stderr
