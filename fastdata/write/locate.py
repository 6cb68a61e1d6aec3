"""Where `fastdata index` finds other tools' tars: a folder, a URL pattern, a list of URLs.

`locate` turns the SOURCE of `fastdata index` into a data root (an absolute folder or a URL prefix
ending in "/") and each tar's name relative to it; `open_tar` opens one tar as a stream (a local
regular file, or an HTTP body streamed through fsspec with the connect and read timeouts of
`fastdata.remote.config.Timeouts`).
"""

from __future__ import annotations

import os
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from fastdata.format.integrity import open_regular

__all__ = ["IndexingError", "Located", "expand_braces", "locate", "open_tar"]

_BRACE = re.compile(r"\{([^{}]*)\}")
_MAX_EXPANSION = 1_000_000


class IndexingError(ValueError):
    """`fastdata index` cannot index the given shards (the message says what to do)."""


def expand_braces(pattern: str) -> list[str]:
    """webdataset's brace notation: `a-{000..002}.tar` -> a-000.tar, a-001.tar, a-002.tar
    (zero-padded to the width of the first bound); `{x,y}` lists; several braces multiply.

    Raises:
        IndexingError: a malformed range or an expansion of more than a million names.
    """
    total = 1
    for body in _BRACE.findall(pattern):  # every brace's choices multiply: bound the product
        if ".." in body:
            first, _, last = body.partition("..")
            count = int(last) - int(first) + 1 if first.isdigit() and last.isdigit() else 1
        else:
            count = body.count(",") + 1
        total *= max(count, 1)
        if total > _MAX_EXPANSION:
            raise IndexingError(f"{pattern!r} expands to more than {_MAX_EXPANSION} names")
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    if ".." in body:
        first, _, last = body.partition("..")
        if not (first.isdigit() and last.isdigit()) or int(last) < int(first):
            raise IndexingError(f"{pattern!r}: {{{body}}} is not a range N..M with N <= M")
        width = len(first)
        choices = [f"{i:0{width}d}" for i in range(int(first), int(last) + 1)]
    else:
        choices = body.split(",")
    if len(choices) > _MAX_EXPANSION:
        raise IndexingError(f"{pattern!r} expands to more than {_MAX_EXPANSION} names")
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [name for c in choices for name in expand_braces(head + c + tail)]


@dataclass(frozen=True)
class Located:
    """The tars of a SOURCE.

    Args:
        data_root: an absolute folder, or a URL prefix ending in "/".
        names: each tar's name relative to `data_root`, in order.
        local_dir: the folder, for a local source (None for URLs).
    """

    data_root: str
    names: list[str]
    local_dir: str | None


def locate(source: str, options: Any) -> Located:
    """The tars of SOURCE: a folder (searched recursively, hidden folders left out), a URL in
    brace notation, a URL of a folder that lists its objects, or a local list file of URLs.

    Args:
        source: as above.
        options: `fastdata.write.index.IndexOptions` (storage options and timeouts for URLs).

    Raises:
        IndexingError: no tars, URLs of several hosts, a URL listed twice, a list file with
            something that is not a URL.
    """
    if "://" in source:
        urls = expand_braces(source)
        if len(urls) == 1 and not urls[0].endswith(".tar"):
            urls = _list_remote(urls[0], options)
        return _common_root(urls, source)
    path = Path(source)
    if path.is_dir():
        root = path.resolve()
        names = sorted(
            p.relative_to(root).as_posix()
            for p in root.rglob("*.tar")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        if not names:
            raise IndexingError(f"{source}: no .tar files in this folder or below it")
        return Located(str(root), names, str(root))
    if path.is_file():
        lines = [ln.strip() for ln in path.read_text().splitlines()]
        urls = [
            u for line in lines if line and not line.startswith("#") for u in expand_braces(line)
        ]
        if not urls or not all("://" in u for u in urls):
            raise IndexingError(
                f"{source}: a list file must hold one shard URL a line (http(s)://, s3://, "
                "gs://); for local tars pass their folder"
            )
        return _common_root(urls, source)
    raise IndexingError(f"{source}: no such folder, list file or URL")


def _list_remote(url: str, options: Any) -> list[str]:
    from fastdata.remote.fs import filesystem

    fs, path = filesystem(url, options.storage_options, options.timeouts)  # type: ignore[arg-type]
    found = sorted(fs.glob(path.rstrip("/") + "/*.tar"))
    if not found:
        raise IndexingError(
            f"{url}: no .tar objects listed there; name the shards with a brace pattern "
            "(https://host/path/shards-{000000..000009}.tar) or a list file of URLs"
        )
    prefix = url.rstrip("/") + "/"
    return [prefix + p.rstrip("/").rsplit("/", 1)[-1] for p in found]


def _common_root(urls: list[str], source: str) -> Located:
    """The longest common folder URL of `urls`, and each URL's name relative to it."""
    heads = [u.rsplit("/", 1)[0] + "/" for u in urls]
    root = os.path.commonprefix(heads)
    root = root[: root.rfind("/") + 1]
    scheme_end = root.find("://") + 3
    if scheme_end < 3 or "/" not in root[scheme_end:]:
        raise IndexingError(
            f"{source}: the shard URLs share no scheme and host (e.g. http://host/path/); "
            "index each store on its own"
        )
    names = [u[len(root) :] for u in urls]
    if len(set(names)) != len(names):
        raise IndexingError(f"{source}: a shard URL is listed twice")
    return Located(root, names, None)


def open_tar(located: Located, name: str, options: Any, stack: ExitStack) -> BinaryIO:
    """Tar `name` of `located` opened for one sequential read, closed by `stack`: a local
    regular file (a FIFO is refused), or a remote object streamed (HTTP: no range requests)."""
    if located.local_dir is not None:
        return stack.enter_context(
            os.fdopen(open_regular(os.path.join(located.local_dir, name)), "rb")
        )
    from fastdata.remote.fs import filesystem

    url = located.data_root + name
    fs, path = filesystem(url, options.storage_options, options.timeouts)  # type: ignore[arg-type]
    kwargs = {"block_size": 0} if url.split("://", 1)[0].lower() in ("http", "https") else {}
    return stack.enter_context(fs.open(path, "rb", **kwargs))
