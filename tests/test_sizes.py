"""The size bounds this project set itself hold for the whole tree, and each check fails on a
planted breach: no file in tierzero/ or io_engine/ over 600 lines (the aim: 450), no function
over 80 lines, no module docstring over 15 lines (it says what the module is; the reasons live
in `# [Note: ...]` blocks beside the code, the figures in benchmarks/RESULTS.md)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

from builders import REPO

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_DOCSTRING_LINES = 15

# Files, functions and module docstrings allowed past their bound: none. A new exemption needs
# its reason beside it (the test says when one is no longer needed).
EXEMPT_FILES: set[str] = set()
EXEMPT_FUNCTIONS: set[str] = set()
"""'file:function' names allowed over MAX_FUNCTION_LINES (none today)."""
EXEMPT_DOCSTRINGS: set[str] = set()
EXEMPT = {"files": EXEMPT_FILES, "functions": EXEMPT_FUNCTIONS, "docstrings": EXEMPT_DOCSTRINGS}
FIX = {"files": "split it by concern", "functions": "split it by concern",
       "docstrings": "say what the module is; move the rest into `# [Note: ...]` blocks beside the code or docs/"}
BOUNDS = {"files": MAX_FILE_LINES, "functions": MAX_FUNCTION_LINES, "docstrings": MAX_DOCSTRING_LINES}


def sources(root: Path) -> list[Path]:
    return sorted([*root.glob("tierzero/**/*.py"), *root.glob("io_engine/**/*.py")])


def breaches(root: Path, exempt: dict[str, set[str]] | None = None) -> list[str]:
    """Every file, function and module docstring past its bound and not exempt, one line each
    saying what to do; and every exemption no longer needed. `exempt`: each bound's set
    (default: the EXEMPT sets above)."""
    exempt = EXEMPT if exempt is None else exempt
    found = []
    needed: dict[str, set[str]] = {kind: set() for kind in exempt}
    for path in sources(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        for kind, name, n, what in _measures(rel, text, ast.parse(text, filename=rel)):
            if n <= BOUNDS[kind]:
                continue
            needed[kind].add(name)
            if name not in exempt[kind]:
                found.append(f"{name}: {what} is {n} lines, over the bound of {BOUNDS[kind]}; {FIX[kind]}")
    for kind, names in exempt.items():
        for name in sorted(names - needed[kind]):
            found.append(f"{name} is within its {kind} bound now: remove it from tests/test_sizes.py's "
                         f"EXEMPT_{kind.upper()}")
    return found


def _measures(rel: str, text: str, tree: ast.Module) -> Iterator[tuple[str, str, int, str]]:
    """(bound's kind, name, lines, what) for the file, each function and the module docstring."""
    yield "files", rel, len(text.splitlines()), "the file"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield "functions", f"{rel}:{node.name}", node.end_lineno - node.lineno + 1, \
                f"function {node.name} (line {node.lineno})"
    doc = ast.get_docstring(tree, clean=True)
    if doc is not None:
        yield "docstrings", rel, len(doc.splitlines()), "the module docstring"


def test_no_file_function_or_module_docstring_is_past_its_bound() -> None:
    assert breaches(REPO) == []


def plant_tree(root: Path, code: str) -> Path:
    (root / "tierzero").mkdir()
    (root / "io_engine").mkdir()
    (root / "io_engine" / "a.py").write_text(code)
    return root


def _function(lines: int) -> str:
    return "def f():\n" + "    x = 1\n" * (lines - 1)


NONE_EXEMPT: dict[str, set[str]] = {"files": set(), "functions": set(), "docstrings": set()}


@pytest.mark.parametrize("code,what", [
    ('"""What a is."""\n' + _function(MAX_FUNCTION_LINES), None),
    ("x = 1\n" * (MAX_FILE_LINES + 1), "the file is 601 lines"),
    (_function(MAX_FUNCTION_LINES + 1), "function f (line 1) is 81 lines"),
    ('"""' + "A line.\n" * (MAX_DOCSTRING_LINES + 1) + '"""\n', "the module docstring is 16 lines"),
], ids=["within", "long-file", "long-function", "long-docstring"])
def test_a_planted_breach_is_found(tmp_path: Path, code: str, what: str | None) -> None:
    found = breaches(plant_tree(tmp_path, code), NONE_EXEMPT)
    if what is None:
        assert found == []
    else:
        assert len(found) == 1 and what in found[0] and found[0].startswith("io_engine/a.py"), found


def test_an_exemption_no_longer_needed_is_found(tmp_path: Path) -> None:
    found = breaches(plant_tree(tmp_path, "x = 1\n"), {**NONE_EXEMPT, "files": {"io_engine/a.py"}})
    assert found == ["io_engine/a.py is within its files bound now: remove it from tests/test_sizes.py's EXEMPT_FILES"]


def test_an_exempt_breach_passes(tmp_path: Path) -> None:
    long_file = "x = 1\n" * (MAX_FILE_LINES + 1)
    assert breaches(plant_tree(tmp_path, long_file), {**NONE_EXEMPT, "files": {"io_engine/a.py"}}) == []
