"""The code blocks, headings and links of README.md and docs/*.md, for the tests that run them.

A block is known by a readable id: its page, the GitHub anchor of the section it is in, and
its place among that section's blocks (`README.md#try-it:3`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```(\S*)\s*$")
_HEADING = re.compile(r"^(#{1,6}) (.+?)\s*#*\s*$")
# [text](target) outside code spans; images too. The target stops at whitespace or ")".
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`]*`")


def pages() -> list[Path]:
    """README.md, then every page of docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped,
    spaces to hyphens (code spans keep their text)."""
    text = heading.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@dataclass(frozen=True)
class Block:
    page: Path
    lang: str
    code: str
    section: str  # the anchor of the heading it is under ("" before any)
    place: int  # 1-based, among the blocks of its section
    line: int  # of its opening fence, 1-based

    @property
    def id(self) -> str:
        return f"{name(self.page)}#{self.section}:{self.place}"


@dataclass(frozen=True)
class Page:
    blocks: tuple[Block, ...]
    anchors: frozenset[str]
    links: tuple[tuple[int, str], ...]  # (line, target) of every link outside code


@cache
def parse(page: Path) -> Page:
    blocks: list[Block] = []
    anchors: list[str] = []
    links: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    section = ""
    places: dict[str, int] = {}
    fence: tuple[str, int, list[str]] | None = None
    prose: list[str] = []  # the page with its code blocks blanked, for links across lines
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        opened = _FENCE.match(line)
        prose.append("" if fence is not None or opened else line)
        if fence is not None:
            if line.rstrip() == "```":
                lang, start, body = fence
                places[section] = places.get(section, 0) + 1
                code = "".join(f"{text}\n" for text in body)
                blocks.append(Block(page, lang, code, section, places[section], start))
                fence = None
            else:
                fence[2].append(line)
            continue
        if opened:
            fence = (opened[1], number, [])
            continue
        heading = _HEADING.match(line)
        if heading:
            base = slug(heading[2])
            count = seen.get(base, 0)
            seen[base] = count + 1
            section = base if count == 0 else f"{base}-{count}"
            anchors.append(section)
    assert fence is None, f"{name(page)}: a code block opened on line {fence[1]} never closes"
    # Code spans blanked (keeping line breaks), then links, whose text may span lines.
    text = _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), "\n".join(prose))
    for match in _LINK.finditer(text):
        links.append((text.count("\n", 0, match.start()) + 1, match[1]))
    return Page(tuple(blocks), frozenset(anchors), tuple(links))


def blocks(lang: str | None = None, only: list[Path] | None = None) -> list[Block]:
    """The code blocks of README.md and docs/ (or of `only`), in page order; of one language
    if `lang` is given."""
    found = [b for page in (only or pages()) for b in parse(page).blocks]
    return [b for b in found if lang is None or b.lang == lang]


def following(block: Block) -> Block | None:
    """The next block on this one's page, if any."""
    page = parse(block.page).blocks
    index = page.index(block)
    return page[index + 1] if index + 1 < len(page) else None
