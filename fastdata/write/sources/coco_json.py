"""A COCO json read as a stream: one list element at a time, never the whole document.

`json.loads` of a COCO instances file holds every annotation as a dict, its polygons as lists of
floats: ~6.8x the file's size (a 200 MB json peaked at 1.37 GB). `stream_lists` reads the file
in 1 MiB chunks and decodes one element of the top-level lists at a time (`json.JSONDecoder
.raw_decode`, the standard library's own parser), so the caller keeps only what it needs of each
(`fastdata.write.sources.coco` keeps a few numbers per annotation) and the memory held is a chunk plus
one element. Other top-level values ("info", "licenses") are decoded one at a time and dropped.

The json is untrusted: its size is bounded while it is read (`max_bytes`), the number of list
elements while they are decoded (`max_entries`), and a malformed document is an error that says
what was expected, not a partial read.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from fastdata.write.sources.base import BadSourceError, describe_path

__all__ = ["stream_lists"]

_CHUNK = 1 << 20
_SPACE = re.compile(r"[ \t\n\r]*")
# A value cut by the chunk's end fails within a few characters of it ("tru|e", "1.|5", "\u00|e9"),
# or as an unterminated string; any other error is the document's own.
_TAIL = 32


def stream_lists(
    path: Path,
    keys: tuple[str, ...],
    required: tuple[str, ...],
    max_bytes: int,
    max_entries: int,
    hint: str,
) -> Iterator[tuple[str, int, Any]]:
    """(key, index, element) of every element of the top-level lists named by `keys`, in file
    order; the document must be one JSON object.

    Args:
        path: the json file.
        keys: the top-level keys whose values are lists to stream; other keys are skipped.
        required: those of `keys` the document must have (an absent other one is empty).
        max_bytes: the most bytes read (the error names `max_json_bytes`).
        max_entries: the most elements of those lists, together.
        hint: what a COCO json looks like, appended to structural errors.

    Raises:
        BadSourceError: unreadable, larger than `max_bytes`, more than `max_entries` elements,
            not valid JSON or not an object, a streamed key that is not a list or appears twice.
    """
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise BadSourceError(_too_large(path, f"{size:,} bytes", max_bytes))
        f = open(path, "rb")  # noqa: SIM115 - closed below, also when the caller stops early
    except OSError as exc:
        raise BadSourceError(f"{describe_path(path)}: cannot read ({exc.strerror or exc})") from exc
    with f:
        yield from _Parser(_Stream(f, path, max_bytes), path, hint).lists(
            keys, required, max_entries
        )


def _too_large(path: Path, what: str, max_bytes: int) -> str:
    return (
        f"{path}: {what} is more than max_json_bytes={max_bytes:,}; if the file is trusted, "
        "raise it (`fastdata shard coco --max-json-bytes 4G`, or CocoSource(max_json_bytes=...))"
    )


class _Stream:
    """The file's text in a sliding window: `buf[pos:]` is what is not consumed yet."""

    def __init__(self, f: BinaryIO, path: Path, max_bytes: int) -> None:
        self.f, self.path, self.max_bytes = f, path, max_bytes
        self.text = codecs.getincrementaldecoder("utf-8-sig")()
        self.buf, self.pos, self.read, self.eof = "", 0, 0, False

    def more(self, at_least: int = 0) -> bool:
        """Append the next chunk (at least `at_least` characters' worth); False at the end."""
        if self.eof:
            return False
        data = self.f.read(max(_CHUNK, at_least))
        self.read += len(data)
        if self.read > self.max_bytes:  # the file grew since its size was checked
            raise BadSourceError(_too_large(self.path, "the file", self.max_bytes))
        try:
            text = self.text.decode(data, final=not data)
        except UnicodeDecodeError as exc:
            raise BadSourceError(f"{self.path}: not valid JSON (not UTF-8: {exc})") from None
        self.eof = not data
        self.buf = self.buf[self.pos :] + text  # drop what is consumed: the window stays small
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not white space ('' at the end), not consumed."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""


class _Parser:
    def __init__(self, stream: _Stream, path: Path, hint: str) -> None:
        self.s, self.path, self.hint = stream, path, hint
        self.decoder = json.JSONDecoder()

    def invalid(self, what: str) -> BadSourceError:
        return BadSourceError(f"{self.path}: not valid JSON ({what}). {self.hint}")

    def expect(self, chars: str) -> str:
        found = self.s.peek()
        if not found or found not in chars:
            wanted = " or ".join(repr(c) for c in chars)
            raise self.invalid(f"expected {wanted}, found {found[:1]!r} ")
        self.s.pos += 1
        return found

    def value(self) -> Any:
        """The next JSON value, read on across chunks until it is whole."""
        s = self.s
        s.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(s.buf, s.pos)
            except json.JSONDecodeError as exc:
                cut = exc.pos >= len(s.buf) - _TAIL or exc.msg.startswith("Unterminated string")
                if not cut or not s.more(len(s.buf) - s.pos):  # grows geometrically
                    raise self.invalid(exc.msg) from None
                continue
            except RecursionError:
                raise self.invalid("nested too deeply") from None
            if end == len(s.buf) and s.more():  # a number may go on in the next chunk
                continue
            s.pos = end
            return value

    def lists(
        self, keys: tuple[str, ...], required: tuple[str, ...], max_entries: int
    ) -> Iterator[tuple[str, int, Any]]:
        s, seen, entries = self.s, set(), 0
        first = s.peek()
        if first != "{":
            raise self.invalid(f"a COCO file is one JSON object {{...}}; it starts with {first!r}")
        s.pos += 1
        while s.peek() != "}":
            if seen:
                self.expect(",")
            key = self.value()
            if not isinstance(key, str):
                raise self.invalid(f"expected a key, found {key!r:.40}")
            self.expect(":")
            if key not in keys:
                self.value()  # "info", "licenses", ...: decoded and dropped
                seen.add(f"\0{key}")
                continue
            if key in seen:
                raise BadSourceError(f"{self.path}: {key!r} appears twice. {self.hint}")
            seen.add(key)
            if s.peek() != "[":
                raise BadSourceError(f"{self.path}: {key!r} must be a list. {self.hint}")
            s.pos += 1
            index = 0
            while s.peek() != "]":
                if index:
                    self.expect(",")
                entries += 1
                if entries > max_entries:
                    raise BadSourceError(
                        f"{self.path}: more than max_entries={max_entries:,} images + "
                        "annotations + categories"
                    )
                yield key, index, self.value()
                index += 1
            s.pos += 1
        s.pos += 1
        if s.peek():
            raise self.invalid("text after the top-level object")
        for key in required:
            if key not in seen:
                raise BadSourceError(f"{self.path}: {key!r} must be a list. {self.hint}")
