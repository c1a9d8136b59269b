"""Every `[Note: ...]` the code, the docs or the benchmarks cite is written once and indexed.

A Note is defined where its name opens the explanation: at the start of a comment or docstring
line, or after a sentence's end, followed by its text (`[Note: rounds] Each policy ...`). It is
cited anywhere else (`See [Note: rounds]`, `[Note: rounds] in benchmarks/prefetch_nvme.py`).
docs/architecture.md's Notes table names the file holding each definition.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from builders import REPO

NOTE = re.compile(r"\[Note: ([^\]]+)\]")
INDEX_ROW = re.compile(r"^\|\s*\[Note: ([^\]]+)\]\s*\|\s*`?([^|`]+?)`?\s*\|\s*$")
OPENS = re.compile(r"[\s#\"']*|.*\.\s+")
"""What may stand before a definition on its line: nothing but indentation, `#` or quotes, or a
sentence that ended."""
PLACEHOLDER = "..."
"""`[Note: ...]` in prose means "a Note", not one of them."""


def sources(root: Path) -> list[Path]:
    """The files whose Notes count: the packages, the benchmarks, the tests, the docs."""
    out = [*root.glob("tierzero/**/*.py"), *root.glob("io_engine/**/*.py"), *root.glob("benchmarks/*.py"),
           *root.glob("benchmarks/*.md"), *root.glob("docs/*.md"), *root.glob("tests/**/*.py")]
    if (root / "README.md").exists():
        out.append(root / "README.md")
    return sorted(p for p in out if p.name != Path(__file__).name)


def is_definition(path: Path, line: str, match: re.Match) -> bool:
    if path.suffix != ".py":
        return False
    before, after = line[:match.start()], line[match.end():]
    opens = OPENS.fullmatch(before) is not None
    return opens and (after.strip() in ("", '"""') or (after.startswith(" ") and not after.startswith(" in ")))


def scan(root: Path) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(definitions, citations): each Note's name to the 'file:line' places it is defined / cited."""
    defined: dict[str, list[str]] = {}
    cited: dict[str, list[str]] = {}
    for path in sources(root):
        rel = path.relative_to(root).as_posix()
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if rel == "docs/architecture.md" and INDEX_ROW.match(line):
                continue  # the index itself
            for m in NOTE.finditer(line):
                if m.group(1) == PLACEHOLDER:
                    continue
                where = defined if is_definition(path, line, m) else cited
                where.setdefault(m.group(1), []).append(f"{rel}:{no}")
    return defined, cited


def index(root: Path) -> dict[str, list[str]]:
    """The Notes table of docs/architecture.md: each name to the files its rows name."""
    text = (root / "docs" / "architecture.md").read_text()
    rows: dict[str, list[str]] = {}
    for line in text.split("\n## Notes", 1)[-1].splitlines():
        m = INDEX_ROW.match(line)
        if m:
            rows.setdefault(m.group(1), []).append(m.group(2).strip())
    return rows


def problems(root: Path) -> list[str]:
    """Every breach, one line each, saying what to fix."""
    defined, cited = scan(root)
    rows = index(root)
    found = []
    for name, places in sorted(defined.items()):
        if len(places) > 1:
            found.append(f"[Note: {name}] is defined {len(places)} times ({', '.join(places)}): keep one, "
                         "cite it elsewhere as 'See [Note: ...]'")
    for name in sorted(set(cited) - set(defined)):
        found.append(f"[Note: {name}] is cited ({', '.join(cited[name])}) but defined nowhere: write it as a "
                     "comment block '# [Note: name] ...' beside the code it explains")
    for name in sorted((set(defined) | set(cited)) - set(rows)):
        where = defined.get(name, ["?"])[0].split(":")[0]
        found.append(f"[Note: {name}] is missing from docs/architecture.md's Notes table: add '| [Note: {name}] "
                     f"| {where} |'")
    for name, files in sorted(rows.items()):
        if len(files) > 1:
            found.append(f"[Note: {name}] has {len(files)} rows in docs/architecture.md's Notes table: keep one")
        homes = sorted({p.split(":")[0] for p in defined.get(name, [])})
        if not (root / files[0]).is_file():
            found.append(f"docs/architecture.md indexes [Note: {name}] in {files[0]}, which does not exist")
        elif name not in defined and name not in cited:
            found.append(f"docs/architecture.md indexes [Note: {name}], which nothing defines or cites: drop the row")
        elif homes and files[0] not in homes:
            found.append(f"docs/architecture.md indexes [Note: {name}] in {files[0]}, but it is defined in "
                         f"{', '.join(homes) or 'no file'}: point the row at its definition")
    return found


def test_every_note_is_defined_once_and_indexed() -> None:
    assert problems(REPO) == []


def test_the_index_is_not_empty_and_every_note_sits_in_the_code() -> None:
    defined, _ = scan(REPO)
    assert len(index(REPO)) >= 20 and set(index(REPO)) == set(defined)


def plant_tree(root: Path, code: str, rows: str) -> Path:
    (root / "tierzero").mkdir()
    (root / "docs").mkdir()
    (root / "tierzero" / "a.py").write_text(code)
    (root / "tierzero" / "b.py").write_text("x = 1  # See [Note: kept] for why.\n")
    (root / "docs" / "architecture.md").write_text("# map\n\n## Notes\n\n| note | where |\n|---|---|\n" + rows)
    return root


GOOD = '"""What a is.\n\n[Note: kept] The reason, told once.\n"""\n'
KEPT_ROW = "| [Note: kept] | tierzero/a.py |\n"


@pytest.mark.parametrize("code,rows,what", [
    (GOOD, KEPT_ROW, None),
    ("# [Note: kept] The reason.\n# [Note: kept] Again.\n", KEPT_ROW, "defined 2 times"),
    ("y = 2  # see [Note: kept]\n", KEPT_ROW, "defined nowhere"),
    (GOOD + "# [Note: other] Another reason.\n", KEPT_ROW, "missing from docs/architecture.md"),
    (GOOD, "| [Note: kept] | tierzero/b.py |\n", "but it is defined in tierzero/a.py"),
    (GOOD, "| [Note: kept] | tierzero/gone.py |\n", "does not exist"),
    (GOOD, KEPT_ROW * 2, "2 rows"),
    (GOOD, KEPT_ROW + "| [Note: stale] | tierzero/a.py |\n", "nothing defines or cites"),
], ids=["clean", "twice", "undefined", "unindexed", "wrong-file", "missing-file", "two-rows", "stale-row"])
def test_a_planted_breach_is_found(tmp_path: Path, code: str, rows: str, what: str | None) -> None:
    found = problems(plant_tree(tmp_path, code, rows))
    if what is None:
        assert found == []
    else:
        assert len(found) == 1 and what in found[0], found
