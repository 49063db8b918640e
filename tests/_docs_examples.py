"""The shell and Python examples of the README and ``docs/``, read out of their Markdown.

Sans-io: this module reads text and answers data; ``tests/test_docs.py`` runs what it finds.

What a page may say to the extractor, in HTML comments (invisible once rendered):

- ``<!-- examples: serve ARGS -->`` anywhere in a page: the server its examples assume,
  ``python -m turbospark serve ARGS`` (no ``ARGS``: the default models). Without it, the default
  models. The port is the one the page's examples name (``127.0.0.1:PORT``), 8080 by default.
- ``<!-- not run: REASON -->`` on the line before a fence: the block is shown, not run; the
  reason is required and the test lists these.
- ``<!-- run: serve -->`` before a shell block whose every line starts a server: each line is
  started alone, must print its ``listening on`` line, and must stop with status 0 on SIGINT.

Every other ``sh``/``bash``/``shell``/``python`` block runs, in page order: the Python blocks of a
page in one interpreter (a later block sees an earlier one's names), each shell block in
``bash -e -o pipefail``. A fence ``text output`` right after a block is what the block prints,
compared as doctest compares (``...`` matches anything, whitespace runs are equal).

Nothing escapes it unseen: every other fence must name a language that is only shown
(``SHOWN_LANGUAGES``: text, configuration files), and an indented code block (which no fence
marks) is refused, so an example cannot be written in a form that is never run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RUN_LANGUAGES", "SHOWN_LANGUAGES", "Block", "Page", "read_page"]

RUN_LANGUAGES = {"sh": "shell", "bash": "shell", "shell": "shell", "python": "python"}
SHOWN_LANGUAGES = {"text", "toml", "json", "yaml", "ini", "html"}  # shown, never run
_LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s")

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>```+|~~~+)\s*(?P<info>[^`]*)$")
_COMMENT = re.compile(r"^\s*<!--\s*(?P<body>.*?)\s*-->\s*$")
_PORT = re.compile(r"(?:127\.0\.0\.1|localhost):(\d+)")


class MarkupError(ValueError):
    """A page's example markers do not make sense (named with the page and line)."""


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str  # "shell" or "python"
    code: str
    skip: str | None = None  # the reason it is not run
    serve: bool = False  # every line starts a server
    output: str | None = None  # what it prints, as documented

    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


@dataclass
class Page:
    path: Path
    serve_args: list[str] = field(default_factory=list)
    port: int = 8080
    blocks: list[Block] = field(default_factory=list)


def read_page(path: Path, text: str | None = None) -> Page:
    """The runnable blocks of one Markdown page, with their markers and documented output."""
    text = path.read_text(encoding="utf-8") if text is None else text
    lines = text.splitlines()
    page = Page(path)
    ports: set[int] = set()
    pending: str | None = None  # the comment on the line before a fence
    last: Block | None = None  # the block an output fence may follow
    i = 0
    while i < len(lines):
        line = lines[i]
        if m := _COMMENT.match(line):
            body = m["body"]
            if body.startswith("examples:"):
                page.serve_args = shlex.split(body.removeprefix("examples:").strip())
                if page.serve_args[:1] != ["serve"]:
                    raise MarkupError(f"{path.name}:{i + 1}: 'examples:' takes serve and its flags")
                page.serve_args = page.serve_args[1:]
            elif body.startswith(("not run:", "run:")):
                pending = body
            i += 1
            continue
        m = _FENCE.match(line)
        if not m:
            if line.startswith("    ") and line.strip() and i and not lines[i - 1].strip():
                before = next((b for b in reversed(lines[:i - 1]) if b.strip()), "")
                if not before.startswith((" ", "\t", "|")) and not _LIST_ITEM.match(before):
                    raise MarkupError(f"{path.name}:{i + 1}: an indented code block is never run: fence it")
            if line.strip():
                pending, last = None, None
            i += 1
            continue
        fence, info = m["fence"], m["info"].strip().split()
        start = i
        i += 1
        body_lines = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body_lines.append(lines[i])
            i += 1
        i += 1
        code = "\n".join(body_lines) + "\n"
        language = RUN_LANGUAGES.get(info[0]) if info else None
        if info[:2] == ["text", "output"]:
            if last is None:
                raise MarkupError(f"{path.name}:{start + 1}: an output fence must follow a block that runs")
            last.output = code
            last = None
            pending = None
            continue
        if language is None:
            if not info or info[0] not in SHOWN_LANGUAGES:
                raise MarkupError(f"{path.name}:{start + 1}: a fence of {info[0] if info else 'no language'!r} "
                                  f"is neither run ({', '.join(RUN_LANGUAGES)}) nor only shown "
                                  f"({', '.join(sorted(SHOWN_LANGUAGES))})")
            if pending is not None:
                raise MarkupError(f"{path.name}:{start + 1}: a marker before a block that never runs")
            last = None
            continue
        block = Block(path, start + 1, language, code)
        if pending is not None:
            if pending.startswith("not run:"):
                block.skip = pending.removeprefix("not run:").strip()
                if not block.skip:
                    raise MarkupError(f"{block.where()}: 'not run:' needs a reason")
            elif pending == "run: serve":
                if language != "shell":
                    raise MarkupError(f"{block.where()}: 'run: serve' is for shell blocks")
                block.serve = True
            else:
                raise MarkupError(f"{block.where()}: unknown marker '{pending}'")
        pending = None
        ports.update(int(p) for p in _PORT.findall(code))
        page.blocks.append(block)
        last = block if block.skip is None else None
    for_server = ports - {int(p) for b in page.blocks if b.serve for p in _PORT.findall(b.code)}
    if len(for_server) > 1:
        raise MarkupError(f"{path.name}: its examples name several ports: {sorted(for_server)}")
    if for_server:
        page.port = for_server.pop()
    return page


def serve_lines(block: Block) -> list[list[str]]:
    """The commands of a ``run: serve`` block, each as its words (comments dropped)."""
    commands = []
    for line in block.code.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            commands.append(words)
    return commands
