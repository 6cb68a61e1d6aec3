"""What the docs test reads from a Markdown page: its code blocks and its `docs-test` directives.

Conventions (shared by every page of README.md and docs/):

- `<!-- docs-test: covered-by tests/<path>::<test> -->` as a page's first line: a dedicated test
  runs the page's blocks; the generic test only checks that this test exists.
- `<!-- docs-test: skip <reason> -->` right before a block: the block is not run. The reason is
  required (multi-node, GPU, needs a cluster, or `long run: ...` for a block over ~60 s).
- `<!-- docs-test: expect <text> -->` anywhere: the page's output (its bash script's output and
  what its python blocks print) must contain <text>.
- ```python and ```bash blocks run; every other block (```text, no language) never does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                    re.M | re.S)  # fmt: skip
_DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(?P<kind>[\w-]+)(?P<arg>.*?)-->", re.S)
RUN_LANGS = ("python", "bash")


class DirectiveError(ValueError):
    """A `docs-test` directive the harness cannot honour (named with its page and line)."""


@dataclass
class Block:
    """One fenced code block: its language, its text (dedented) and the line it starts on."""

    lang: str
    code: str
    line: int
    skip_reason: str | None = None


@dataclass
class Page:
    """A page's runnable blocks and directives."""

    path: Path
    blocks: list[Block] = field(default_factory=list)
    covered_by: str | None = None
    expects: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.relative_to(REPO).as_posix()

    def runnable(self, lang: str) -> list[Block]:
        return [b for b in self.blocks if b.lang == lang and b.skip_reason is None]

    @property
    def needs_real_data(self) -> bool:
        return any("../shared/data" in b.code for lang in RUN_LANGS for b in self.runnable(lang))


def _dedent(body: str, indent: str) -> str:
    return "".join(line[len(indent) :] if line.startswith(indent) else line
                   for line in body.splitlines(keepends=True))  # fmt: skip


def parse_page(path: Path) -> Page:
    """Read PATH's blocks and directives; a malformed directive raises `DirectiveError`."""
    text = path.read_text()
    page = Page(path)
    first = text.lstrip().splitlines()[0] if text.strip() else ""
    for match in _DIRECTIVE.finditer(text):
        kind, arg = match["kind"], match["arg"].strip()
        line = text.count("\n", 0, match.start()) + 1
        where = f"{path.name}:{line}"
        if kind == "covered-by":
            if match.group(0) != first.strip():
                raise DirectiveError(f"{where}: covered-by must be the page's first line")
            if not re.fullmatch(r"tests/\S+\.py::\w+", arg):
                raise DirectiveError(
                    f"{where}: covered-by needs tests/<path>.py::<test>, not {arg!r}"
                )
            page.covered_by = arg
        elif kind == "expect":
            if not arg:
                raise DirectiveError(f"{where}: expect needs the text the output must contain")
            page.expects.append(arg)
        elif kind != "skip":
            raise DirectiveError(f"{where}: unknown docs-test directive {kind!r}")
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip()
        skip = None
        last = list(_DIRECTIVE.finditer(before))
        if last and last[-1].end() == len(before) and last[-1]["kind"] == "skip":
            skip = last[-1]["arg"].strip()
            if not skip:
                raise DirectiveError(f"{path.name}:{line}: docs-test skip needs a reason")
        page.blocks.append(
            Block(match["lang"], _dedent(match["body"], match["indent"]), line, skip)
        )
    return page


def doc_pages() -> list[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
