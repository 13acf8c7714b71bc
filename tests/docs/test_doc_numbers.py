"""Numbers in the docs that go stale (issue 46): counts of tests, lines, files or checks are kept
out of the docs unless they belong to a dated record of a run; the README's Results table copies
no figure that the docs page it names does not hold (each measured figure has one home, with its
command and date, on that page); and every sentence that lists the GPU architectures the build
compiles lists those of setup.py."""
import re

import pytest

from tests.docs.doc_blocks import ROOT, pages

_NUMBER_WORDS = "one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve"
_COUNT = re.compile(rf"\b(\d[\d,]*|{_NUMBER_WORDS}) (?:small )?(?:CPU |CUDA |C\+\+ |Python |test |source )?"
                    r"(?:tests|test cases|lines|files|checks)\b", re.IGNORECASE)
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_no_count_that_goes_stale(page):
    """A count of tests / lines / files / checks is stale after the next commit; only a dated record
    of a run (a line with its date) may quote one."""
    lines = enumerate(page.read_text().splitlines(), 1)
    stale = [f"{page.name}:{number}: {line.strip()[:120]}" for number, line in lines
             if _COUNT.search(line) and not _DATE.search(line)]
    assert stale == []


_TO_BASE = {"ms": ("s", 1e-3), "s": ("s", 1.0), "MiB": ("MiB", 1.0)}


def _figures(text):
    """(value in s or MiB, unit, decimals) of every 'number unit' in text; '17.3 / 30.1 s' gives both."""
    found = []
    for match in re.finditer(r"(\d[\d,]*(?:\.\d+)?)((?: / \d[\d,]*(?:\.\d+)?)*) ?(ms|s|MiB)\b", text):
        unit, scale = _TO_BASE[match.group(3)]
        for number in [match.group(1)] + re.findall(r"\d[\d,]*(?:\.\d+)?", match.group(2)):
            decimals = len(number.split(".")[1]) if "." in number else 0
            decimals += 3 if match.group(3) == "ms" else 0
            found.append((float(number.replace(",", "")) * scale, unit, decimals))
    return found


def _results_rows():
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) >= 8
    return rows


@pytest.mark.parametrize("row", _results_rows(), ids=lambda r: r[2:40])
def test_readme_results_figures_are_on_the_page_they_name(row):
    """Every time and memory figure of the row is one the named docs page reports (to the README's
    precision; ms and s alike), so that the page, with its command and date, is the figure's home."""
    cells = [c.strip() for c in row.strip("|").split("|")]
    named = re.findall(r"docs/\w+\.md", cells[0])
    assert named, f"the row must name the docs page of its figures: {cells[0]}"
    on_page = [f for page in named for f in _figures((ROOT / page).read_text())]
    # a table whose header gives the unit holds bare numbers: taken as seconds or MiB alike
    table_lines = [line for page in named for line in (ROOT / page).read_text().splitlines() if line.startswith("|")]
    on_page += [(float(n.replace(",", "")), unit, 0) for line in table_lines
                for n in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\w.])", line) for unit in ("s", "MiB")]
    missing = []
    for value, unit, decimals in _figures(" | ".join(cells[1:])):
        step = 10.0 ** -decimals
        if not any(u == unit and abs(v - value) <= step / 2 + 1e-9 * max(1.0, value) for v, u, _ in on_page):
            missing.append(f"{value:g} {unit}")
    assert missing == [], f"{named}: {missing}"


_COMPILED_FOR = re.compile(r"\b(?:compiles?|compiled)(?: them| it)? (?:for )?\(?"
                           r"(sm_\d+(?:(?:,| and| plus|,? and) sm_\d+)*)")


def _build_archs():
    setup = (ROOT / "setup.py").read_text()
    archs = re.search(r'DEFAULT_ARCHS = "([^"]*)"', setup).group(1)
    return {"sm_" + a.split("+")[0].replace(".", "") for a in archs.split(";")}


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_statements_of_the_compiled_architectures_list_the_builds(page):
    """A paragraph saying what the build compiles for (e.g. 'compiles for sm_80, ...') names every
    architecture of setup.py's DEFAULT_ARCHS and no other."""
    archs, wrong = _build_archs(), []
    for paragraph in page.read_text().split("\n\n"):
        flat = " ".join(paragraph.split())
        for match in _COMPILED_FOR.finditer(flat):
            named = set(re.findall(r"sm_\d+", match.group(1)))
            if named != archs:
                wrong.append(f"{match.group(0)[:80]} (the build: {sorted(archs)})")
    assert wrong == []
