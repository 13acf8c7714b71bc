"""pyproject's torch floor matches what the code needs.

FEATURES lists every torch feature that clipshard uses and that older torch releases lack, with the
release that introduced it and how to find it in the sources. The floor in pyproject must be the
newest of those releases, and every feature listed must still be in use (a stale entry would hold
the floor up for nothing). A new feature from a newer torch must be added here; the test cannot
discover unlisted APIs by itself."""
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def aten_calls(name):
    """Argument counts of every `at::<name>(...)` call in csrc (top-level commas + 1)."""
    counts = []
    for path in ROOT.glob("csrc/**/*"):
        if path.suffix not in (".h", ".cpp", ".cu", ".cuh"):
            continue
        text = path.read_text()
        for match in re.finditer(rf"\bat::{name}\(", text):
            depth, args, k = 1, 1, match.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[k], 0)
                args += text[k] == "," and depth == 1
                k += 1
            counts.append(args)
    return counts


def python_uses(api):
    return any(api in p.read_text() for p in ROOT.glob("clipshard/**/*.py"))


# feature -> (torch release that introduced it, is it used?)
FEATURES = {
    "torch.library.register_fake": ((2, 4), lambda: python_uses("torch.library.register_fake")),
    "torch.library.register_autograd": ((2, 4), lambda: python_uses("torch.library.register_autograd")),
    # mm.dtype_out: at::mm_out(out, a, b, out_dtype), 16-bit factors into an fp32 result.
    "ATen mm with out_dtype": ((2, 8), lambda: 4 in aten_calls("mm_out")),
    # addmm.dtype_out: at::addmm_out(out, self, a, b, out_dtype); used only where the running torch
    # accepts an fp32 accumulator (chunk_driver.h probes it), but it must exist to compile.
    "ATen addmm with out_dtype": ((2, 8), lambda: 5 in aten_calls("addmm_out")),
}


def pyproject_floor():
    text = (ROOT / "pyproject.toml").read_text()
    found = re.findall(r'"torch\s*>=\s*(\d+)\.(\d+)[^"]*"', text)
    assert len(found) == 1, f"expected one torch>=X.Y requirement in pyproject.toml, found {found}"
    return tuple(int(v) for v in found[0])


def test_every_listed_feature_is_used():
    unused = [name for name, (_, used) in FEATURES.items() if not used()]
    assert not unused, f"listed in FEATURES but not used any more (drop them, maybe lower the floor): {unused}"


def test_pyproject_floor_is_the_newest_feature_release():
    needed = max(version for version, _ in FEATURES.values())
    floor = pyproject_floor()
    newest = [name for name, (version, _) in FEATURES.items() if version == needed]
    assert floor == needed, (f"pyproject.toml says torch>={floor[0]}.{floor[1]}, but {newest} need "
                             f"torch>={needed[0]}.{needed[1]}")


def test_no_build_decision_by_torch_version_macro():
    """Build paths are chosen by what the running torch accepts, not by TORCH_VERSION macros."""
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.glob("csrc/**/*")
                 if p.suffix in (".h", ".cpp", ".cu", ".cuh") and "TORCH_VERSION_M" in p.read_text()]
    assert not offenders, f"TORCH_VERSION_MAJOR/MINOR used in {offenders}"


def test_ci_compiles_the_sources_as_cxx17_against_the_floor():
    """torch up to 2.11 builds extensions with -std=c++17, CI's torch with -std=c++20: CI's
    .ci/cxx17_check.sh compiles csrc as C++17 against the floor's headers (docs/gpu_check.md)."""
    assert "bash .ci/cxx17_check.sh" in (ROOT / ".ci" / "run").read_text()
    done = subprocess.run(["bash", str(ROOT / ".ci" / "cxx17_check.sh"), "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["%d.%d.0" % pyproject_floor()], done.stderr
