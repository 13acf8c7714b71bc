"""The ```python blocks of README.md and docs/*.md, with the doc-test marker in front of each
(docs/development.md, "Code in the docs"): an HTML comment on the line before the fence,

    <!-- doc-test: WORD, WORD ... -->

where a WORD is a kind of block the test does not run (`signature`: a call's parameters, not code;
`needs-gpu`, `torchrun`: code for a GPU or for a torchrun launch, compiled and its names checked
here) or the name of a fragment of tests/docs/doc_fragments.py that supplies the names the block
assumes (`model`, `x`). A block without a marker runs as it is."""
import ast
import builtins
import dataclasses
import pathlib
import re
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOT_RUN = ("signature", "needs-gpu", "torchrun")
_PYTHON_FENCES = ("```python", "```py", "```python3")
_MARKER = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str   # relative to the repository root
    line: int   # of the opening fence, 1-based
    code: str
    words: tuple  # the marker's words; () without a marker

    @property
    def where(self):
        return f"{self.page}:{self.line}"

    @property
    def runs(self):
        return not any(word in NOT_RUN for word in self.words)


def pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(page):
    """Every ```python (or ```py) block of `page`, also one indented in a list, with its marker's words."""
    lines = page.read_text().splitlines()
    where = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].strip() in _PYTHON_FENCES:
            start = index
            end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() == "```"), None)
            if end is None:
                raise ValueError(f"{where}:{start + 1}: a ```python block without its closing fence")
            before = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
            found = _MARKER.match(before.strip())
            words = tuple(w.strip() for w in found.group(1).split(",")) if found else ()
            code = textwrap.dedent("\n".join(lines[start + 1:end]))
            blocks.append(Block(where, start + 1, code, words))
            index = end
        index += 1
    return blocks


def all_blocks():
    return [block for page in pages() for block in python_blocks(page)]


def free_names(code):
    """Names `code` reads that it never binds (nor are builtins)."""
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound


def clipshard_names(code):
    """The dotted names clipshard.x.y the block refers to."""
    return sorted(set(re.findall(r"\bclipshard(?:\.[A-Za-z_]\w*)+", code)))
