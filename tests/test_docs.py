"""The README is a short front door whose links, commands and flags are true.

Every relative link in the README, docs/*.md and benchmarks/RESULTS.md reaches a file, and its
`#anchor` a heading there (GitHub's anchors); the README links every page of docs/; its two
commands are Makefile targets; every `--flag` written after `tierzero CMD` is one of CMD's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from builders import REPO
from tierzero import cli

README_MAX_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"tierzero(?:\.cli)? ((?:train|estimate|tune|export|bench-io)(?:\|(?:train|estimate|tune))*)\b")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "RESULTS.md"]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(text):
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """Each link of `page` that reaches no file under `root`, or no heading of the file it reaches."""
    found = []
    for target in LINK.findall("\n".join(prose_lines(page.read_text()))):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        rel = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else str(dest)
        here = page.relative_to(root).as_posix()
        if not dest.exists():
            found.append(f"{here}: {target}: no file {rel}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            found.append(f"{here}: {target}: no heading with that anchor in {rel}")
    return found


def test_every_link_reaches_its_file_and_heading() -> None:
    assert [b for page in pages() for b in broken_links(page)] == []


def test_the_anchors_follow_githubs_rules() -> None:
    text = ("# A b\n## Disks, and the disk's `limit`\n```\n# not a heading\n```\n## A b\n"
            "### trace.json — in Perfetto\n")
    assert anchors(text) == {"a-b", "disks-and-the-disks-limit", "a-b-1", "tracejson--in-perfetto"}


def test_the_readme_is_a_front_door_linking_every_page() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall(text)}
    unlinked = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert unlinked == [], "add each page of docs/ to the README's More list"


def test_the_readmes_two_commands_are_make_targets() -> None:
    text = (REPO / "README.md").read_text()
    makefile = (REPO / "Makefile").read_text()
    for target in ("demo", "test"):
        assert f"make {target}" in text and re.search(rf"^{target}:", makefile, re.M), target


def commands_written(text: str) -> list[tuple[str, str, str]]:
    """(command, flag, the line) for every `--flag` written after `tierzero CMD` in a code span or a
    code block (a block's lines ending in a backslash read as one)."""
    spans = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    lines = [line for block in spans for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`([^`\n]*tierzero[^`\n]*)`", re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " "))
    found = []
    for line in lines:
        hits = list(COMMAND.finditer(line))
        for i, m in enumerate(hits):
            end = hits[i + 1].start() if i + 1 < len(hits) else len(line)
            for flag in FLAG.findall(line[m.end():end].split("#")[0]):
                found += [(cmd, flag, line.strip()) for cmd in m.group(1).split("|")]
    return found


def flags_of(command: str, capsys: pytest.CaptureFixture) -> set[str]:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    return set(FLAG.findall(capsys.readouterr().out))


def test_every_flag_the_docs_write_is_one_of_its_commands(capsys: pytest.CaptureFixture) -> None:
    written = [w for page in pages()[:-1] for w in commands_written(page.read_text())]
    assert {cmd for cmd, _, _ in written} == {"train", "estimate", "tune", "export", "bench-io"}
    known = {cmd: flags_of(cmd, capsys) for cmd in {cmd for cmd, _, _ in written}}
    assert [w for w in written if w[1] not in known[w[0]]] == []


def test_a_wrong_flag_or_link_is_found(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text = "run `tierzero train --stepz 3` and\n```sh\ntierzero tune --model m \\\n  --simulat\n```\n"
    written = commands_written(text)
    assert sorted((c, f) for c, f, _ in written) == [("train", "--stepz"), ("tune", "--model"), ("tune", "--simulat")]
    assert "--steps" in flags_of("train", capsys) and "--stepz" not in flags_of("train", capsys)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "cli.md").write_text("# The command\n## `tierzero train`\n")
    page = tmp_path / "docs" / "bad.md"
    page.write_text("[a](cli.md#tierzero-train) [x](cli.md#no-such-heading) [y](gone.md) "
                    "[z](https://example.com/a#b)\n")
    found = broken_links(page, tmp_path)
    assert len(found) == 2 and "no heading" in found[0] and "no file docs/gone.md" in found[1], found
