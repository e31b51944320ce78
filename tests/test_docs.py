"""The README and docs/ hold up in a clean clone: every relative link leads to a file of the
checkout (and a #heading to a heading of it), and the README starts with the set-up commands."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    # GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_in_the_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or ROOT not in file.parents:
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_starts_with_the_commands_that_set_everything_up():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first_block = text.split("```")[1]
    for command in ("make demo", "make test", "make lab"):
        assert f"\n{command} " in first_block, command
    assert len(text.split()) < 1200  # a page a newcomer reads in five minutes


TEST_FILE = re.compile(r"\btests/[\w/]+\.py(?:::(\w+))?")
TEST_NAME = re.compile(r"\btest_\w+")
# A sentence: from the end of the one before (". " then a capital or a backquote, a table cell's
# "|", a blank line) to the end of its own.
SENTENCE = re.compile(r"(?:^|(?<=[.!?]) +(?=[A-Z`])|\|\s*|\n\s*\n)(.+?)(?=(?<=[.!?]) +[A-Z`]|\||\n\s*\n|$)",
                      re.S)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_test_the_docs_name_exists():
    defined: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        defined[path.relative_to(ROOT).as_posix()] = set(
            re.findall(r"^(?:async )?def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
    known = {n for names in defined.values() for n in names} | {
        Path(p).stem for p in defined}
    missing = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        for m in TEST_FILE.finditer(text):
            file, name = m.group(0).split("::")[0], m.group(1)
            if file not in defined:
                missing.append(f"{page.name}: {file}")
            elif name and name not in defined[file]:
                missing.append(f"{page.name}: {m.group(0)}")
        missing += [f"{page.name}: {n}" for n in TEST_NAME.findall(text) if n not in known]
    assert not missing, missing


def test_every_sentence_that_says_tested_names_its_test():
    unnamed = []
    for page in _pages():
        for sentence in SENTENCE.findall(page.read_text(encoding="utf-8")):
            if re.search(r"\btested\b", sentence, re.I) and not re.search(
                    r"tests/|\btest_\w+", sentence):
                unnamed.append(f"{page.name}: {' '.join(sentence.split())[:160]}")
    assert not unnamed, unnamed
