"""Rows kept on disk, read back one at a time: a source's index that does not grow in memory.

A list of 100 million rows held as Python objects costs tens of GB; even as compact columns
(`path` bytes, an 8-byte offset, label and line) it is ~40 bytes a row, 4 GB. `RowFile` appends
each row's bytes to a file and its end offset to a second one, through fixed-size buffers, and
reads row `i` back with two `pread`s (offsets, then bytes): the process holds a few hundred KB
whatever the count; the rows sit in the file system's page cache, which the kernel may drop.
`pread` keeps one descriptor usable by forked writer processes at once (no shared file position).

The files live in a private temporary folder (`tempfile.mkdtemp`) removed when the last
`RowFile` of the process that made it is collected, or at exit. A pickled `RowFile` (sent to a
Ray worker) names the files: the receiving process opens them by path and never removes them,
so a worker on another node needs the folder on a file system it shares (`RowFile.move_to`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from array import array
from pathlib import Path
from typing import Any

__all__ = ["RowFile", "RowFolder"]

_OFFSET = 8  # bytes of each end offset (int64, native order)
_BUFFER = 1 << 18  # bytes of rows (and of offsets) gathered before each write


class RowFolder:
    """A private temporary folder for `RowFile`s, removed with the last reference to it (in the
    process that made it: forked or unpickled copies leave it alone)."""

    def __init__(self, prefix: str = "fastdata-rows-") -> None:
        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        self._finalizer = weakref.finalize(self, _remove_folder, self.path, os.getpid())

    def remove(self) -> None:
        """Remove the folder now (its files are gone for every `RowFile` in it)."""
        self._finalizer()

    def __reduce__(self) -> tuple[Any, ...]:
        return Path, (str(self.path),)  # a copy elsewhere names the folder, never removes it


def _remove_folder(path: Path, owner: int) -> None:
    if os.getpid() == owner:  # a forked worker exiting must not take the driver's files
        shutil.rmtree(path, ignore_errors=True)


class RowFile:
    """Byte strings appended once, then read by index.

    Args:
        folder: where the two files go (its lifetime is the caller's: see `RowFolder`).
        name: the files' stem (`<name>.rows`, `<name>.ends`).
    """

    def __init__(self, folder: RowFolder | Path, name: str) -> None:
        self._folder = folder  # kept: the folder lives as long as a RowFile in it
        base = folder.path if isinstance(folder, RowFolder) else Path(folder)
        self.rows_path = base / f"{name}.rows"
        self.ends_path = base / f"{name}.ends"
        self._rows = open(self.rows_path, "wb")  # noqa: SIM115 (closed by finish)
        self._ends = open(self.ends_path, "wb")  # noqa: SIM115
        self._row_buffer = bytearray()
        self._end_buffer = array("q")
        self._size = 0  # bytes of rows appended
        self._count = 0
        self._fds: tuple[int, int] | None = None

    def append(self, row: bytes) -> None:
        """Add one row (only before `finish`)."""
        self._row_buffer += row
        self._size += len(row)
        self._end_buffer.append(self._size)
        self._count += 1
        if len(self._row_buffer) >= _BUFFER or len(self._end_buffer) * _OFFSET >= _BUFFER:
            self._flush()

    def _flush(self) -> None:
        self._rows.write(self._row_buffer)
        self._ends.write(self._end_buffer.tobytes())
        self._row_buffer.clear()
        del self._end_buffer[:]

    def finish(self) -> None:
        """Write what is buffered and open the files for reading (appending ends here)."""
        if self._fds is not None:
            return
        self._flush()
        self._rows.close()
        self._ends.close()
        self._open()

    def _open(self) -> None:
        self._fds = (os.open(self.rows_path, os.O_RDONLY), os.open(self.ends_path, os.O_RDONLY))
        self._closer = weakref.finalize(self, _close_fds, self._fds)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> bytes:
        if self._fds is None:
            raise RuntimeError("RowFile: call finish() before reading rows")
        if not 0 <= index < self._count:
            raise IndexError(f"row {index} of {self._count}")
        rows_fd, ends_fd = self._fds
        if index == 0:
            start, (end,) = 0, array("q", os.pread(ends_fd, _OFFSET, 0))
        else:
            start, end = array("q", os.pread(ends_fd, 2 * _OFFSET, (index - 1) * _OFFSET))
        data = os.pread(rows_fd, end - start, start)
        if len(data) != end - start:
            raise OSError(f"{self.rows_path}: row {index} is cut short (the file was changed)")
        return data

    def move_to(self, folder: Path) -> None:
        """Copy the files into `folder` (e.g. a shared file system every Ray node reaches) and
        read from there; the copies are the caller's to remove."""
        self.finish()
        folder.mkdir(parents=True, exist_ok=True)
        for attr in ("rows_path", "ends_path"):
            path: Path = getattr(self, attr)
            target = folder / path.name
            if target != path:
                shutil.copyfile(path, target)
                setattr(self, attr, target)
        self._closer()  # once: a finalizer runs at most one time
        self._open()

    def __getstate__(self) -> dict[str, Any]:
        self.finish()
        return {
            "rows_path": self.rows_path,
            "ends_path": self.ends_path,
            "count": self._count,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._folder = None  # not the owner: the files stay where they are
        self.rows_path, self.ends_path = state["rows_path"], state["ends_path"]
        self._count = state["count"]
        try:
            self._open()
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"{exc.filename}: the source's rows are not here; on a cluster, put the output "
                "folder on a file system every node reaches (the writer copies the rows there)"
            ) from exc


def _close_fds(fds: tuple[int, int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
