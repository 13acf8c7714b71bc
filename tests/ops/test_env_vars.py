"""The CLIPSHARD_* environment variables (issue 46 item 1, issue 40 item 10): the variables the
docs list (docs/self_check.md's table, and every CLIPSHARD_* name any page mentions) are those of
clipshard/ops/env_vars.py with the same accepted values, the extension's C++ readers accept the same
values, no Python file reads a variable around the one parser, and the self-check refuses a bad
value of every variable on every build (also one the build never reads) with exit status 2."""
import pathlib
import re

import pytest
import torch

import clipshard
from clipshard.diagnostics.environment import environment_report
from clipshard.diagnostics.self_check import main
from clipshard.ops import env_vars

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _documented_table():
    """docs/self_check.md's table of variables: name -> accepted values, in the table's order."""
    text = (ROOT / "docs" / "self_check.md").read_text()
    section = text.split("## The environment variables", 1)[1].split("\n## ", 1)[0]
    table = {}
    for name, accepted in re.findall(r"^\| `(CLIPSHARD_\w+)` \| ([^|]*) \|", section, re.MULTILINE):
        table[name] = tuple(re.findall(r"`([^`]*)`", accepted))
    return table


def test_the_documented_variables_are_the_modules_with_the_same_values():
    assert _documented_table() == {name: v.accepted for name, v in env_vars.VARIABLES.items()}


def test_every_variable_a_page_mentions_is_one_clipshard_knows():
    mentioned = {(page.name, name) for page in DOC_PAGES for name in re.findall(r"CLIPSHARD_[A-Z0-9_]+",
                                                                               page.read_text())}
    assert sorted((page, name) for page, name in mentioned if name not in env_vars.VARIABLES) == []


def test_the_extensions_readers_accept_the_same_values():
    """csrc reads through csrc/env_vars.h's env::choice / env::flag (test_extension_environment.py
    checks that no other getenv exists); their literal choices must be the module's."""
    read = {}
    for source in (ROOT / "csrc").rglob("*"):
        if source.suffix not in (".h", ".cpp", ".cu", ".cuh") or source.name == "env_vars.h":
            continue
        text = source.read_text()
        for name, choices in re.findall(r'env::choice\("(CLIPSHARD_\w+)",\s*\{([^}]*)\}\)', text):
            read[name] = tuple(re.findall(r'"([^"]*)"', choices))
        for name in re.findall(r'env::flag\("(CLIPSHARD_\w+)"\)', text):
            read[name] = env_vars.SWITCH
    assert len(read) >= 3
    assert {name: env_vars.VARIABLES[name].accepted for name in read if name in env_vars.VARIABLES} == read


def test_python_reads_variables_only_through_the_parser():
    """No file of the package reads a CLIPSHARD_* variable with os.environ / os.getenv except the
    parser, the report that lists every raw value, and the checks that set and restore one (the
    self-check's loss checks; the first-use probes' forward rows per CTA, launch_variants.py)."""
    allowed = {"ops/env_vars.py", "diagnostics/environment.py", "diagnostics/loss_checks.py", "ops/launch_variants.py"}
    package = ROOT / "clipshard"
    readers = [str(p.relative_to(package)) for p in package.rglob("*.py")
               if re.search(r"os\.(environ|getenv)", p.read_text()) and str(p.relative_to(package)) not in allowed]
    assert readers == []


@pytest.mark.parametrize("name", sorted(env_vars.VARIABLES))
def test_the_report_refuses_a_bad_value_of_every_variable(monkeypatch, name):
    monkeypatch.setenv(name, "bogus")
    accepted = ", ".join(env_vars.VARIABLES[name].accepted)
    assert environment_report()["problems"] == [
        f"the environment variable {name} is set to 'bogus', which clipshard does not accept: it must be one of "
        f"{accepted} (or unset)"]
    monkeypatch.setenv(name, env_vars.VARIABLES[name].accepted[-1].upper())  # any case
    assert environment_report()["problems"] == []


def test_variables_this_build_never_reads_are_still_refused(monkeypatch, capsys):
    """Issue 46 item 1 / issue 40 item 10: CLIPSHARD_CHUNKED_FORWARD_ROWS=8 (a CUDA kernel's knob,
    never read by a CPU-only build) and CLIPSHARD_FIRST_USE_CHECK=maybe (never read on the CPU)
    made `python -m clipshard` exit 0 with every check passed."""
    monkeypatch.setenv("CLIPSHARD_CHUNKED_FORWARD_ROWS", "8")
    monkeypatch.setenv("CLIPSHARD_FIRST_USE_CHECK", "maybe")
    assert main([]) == 2
    out = capsys.readouterr().out
    assert ("PROBLEM: the environment variable CLIPSHARD_CHUNKED_FORWARD_ROWS is set to '8', which clipshard does "
            "not accept: it must be one of 16, 32 (or unset)\n") in out
    assert ("PROBLEM: the environment variable CLIPSHARD_FIRST_USE_CHECK is set to 'maybe', which clipshard does "
            "not accept: it must be one of 1, true, on, yes, 0, false, off, no (or unset)\n") in out
    assert "FAILED: " not in out and "Could not run" not in out


def test_the_first_use_variable_is_not_read_for_cpu_tensors(monkeypatch):
    """No first-use check applies to the CPU: a refused value raised in every CPU loss call."""
    monkeypatch.setenv("CLIPSHARD_FIRST_USE_CHECK", "maybe")
    g = torch.Generator().manual_seed(0)
    rows, cols = torch.randn(5, 3, generator=g), torch.randn(7, 3, generator=g)
    row_lse, _, _ = clipshard.contrastive_lse(rows, cols, 2.0)
    want = torch.logsumexp(2.0 * rows.double() @ cols.double().T, dim=1)
    torch.testing.assert_close(row_lse.double(), want, rtol=1e-5, atol=1e-6)


def test_the_parser_refuses_what_it_does_not_know(monkeypatch):
    monkeypatch.setenv("CLIPSHARD_ALGORITHM", "Torch")
    assert env_vars.value("CLIPSHARD_ALGORITHM") == "torch"
    monkeypatch.setenv("CLIPSHARD_FIRST_USE_CHECK", "OFF")
    assert env_vars.flag("CLIPSHARD_FIRST_USE_CHECK", True) is False
    monkeypatch.setenv("CLIPSHARD_FIRST_USE_CHECK", "")
    assert env_vars.flag("CLIPSHARD_FIRST_USE_CHECK", True) is True
    monkeypatch.setenv("CLIPSHARD_ALGORITHM", "tourch")
    with pytest.raises(ValueError, match=r"CLIPSHARD_ALGORITHM must be one of auto, torch \(or unset\), got 'tourch'"):
        env_vars.value("CLIPSHARD_ALGORITHM")
