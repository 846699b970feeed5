"""What the docs tests read: the user docs (README.md, docs/*.md, the node's help page) and
their parts (headings, sections, fenced code blocks), outside code blocks where it matters."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
HELP_PAGE = REPO / "web" / "docs" / "MultiNPUParallelConfig.md"  # what ComfyUI shows as the node's help


def user_docs() -> list[Path]:
    """README.md and every docs/*.md: where the project's prose lives."""
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def without_code_blocks(text: str) -> str:
    # a `# comment` in a bash block is not a heading, a link in one is not a link
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def doc_headings(doc: Path) -> list[str]:
    """A Markdown file's headings as written, outside code blocks."""
    return [m.strip() for m in re.findall(r"^#{1,6} (.+)$", without_code_blocks(doc.read_text(encoding="utf-8")), re.M)]


def section(doc: Path, heading: str) -> str:
    """The text under `heading` (as written after the #s) up to the next heading of its level or above."""
    text = without_code_blocks(doc.read_text(encoding="utf-8"))
    start = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
    assert start, f"{doc.relative_to(REPO)} has no heading {heading!r}"
    rest = text[start.end():]
    end = re.search(rf"^#{{1,{len(start.group(1))}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def fenced_blocks(doc: Path, languages: tuple[str, ...]) -> list[str]:
    """The bodies of the fenced code blocks of `doc` whose language is one of `languages`."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", doc.read_text(encoding="utf-8"), re.M | re.S)
    return [body for language, body in blocks if language in languages]
