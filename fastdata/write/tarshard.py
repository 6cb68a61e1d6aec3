"""One tar shard and its DALI index, written deterministically.

Every member header is fixed (mtime 0, uid/gid 0, no user names, mode 0444, ustar), so the same
samples in the same order give byte-identical tars. Offsets are recorded while writing, so the
DALI index (`v1.2` format of DALI's `wds2idx`) costs nothing extra and DALI never scans a tar.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

__all__ = ["INDEX_VERSION", "ShardTarWriter", "sha256_file"]

INDEX_VERSION = "v1.2"
_BLOCK = 512


class ShardTarWriter:
    """Write samples (key -> {ext: bytes}) to `path`, and the DALI index to `index_path`.

    Both are written under temporary names; `commit()` renames them into place (index first, so
    a tar under its final name always has its index), `abort()` removes them.
    """

    def __init__(self, path: Path, index_path: Path) -> None:
        self.path = path
        self.index_path = index_path
        suffix = f".tmp-{os.getpid()}"
        self._tmp = path.with_name(path.name + suffix)
        self._tmp_index = index_path.with_name(index_path.name + suffix)
        self._file = open(self._tmp, "wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)
        self._index_lines: list[str] = []
        self.num_samples = 0

    def write(self, key: str, components: dict[str, bytes]) -> None:
        """Append one sample; components are written in sorted extension order."""
        if "." in key or "/" in key:
            raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
        entries = []
        for ext in sorted(components):
            data = components[ext]
            name = f"{key}.{ext}"
            header_offset = self._tar.offset
            self._tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))
            entries.append(f"{ext} {header_offset + _BLOCK} {len(data)} {name}")
        self._index_lines.append(" ".join(entries))
        self.num_samples += 1

    def commit(self) -> tuple[int, str]:
        """Close, fsync and rename into place. Returns (tar bytes, tar sha256)."""
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        header = f"{INDEX_VERSION} {self.num_samples}\n"
        self._tmp_index.write_text(header + "".join(line + "\n" for line in self._index_lines))
        os.replace(self._tmp_index, self.index_path)
        os.replace(self._tmp, self.path)
        return self.path.stat().st_size, sha256_file(self.path)

    def abort(self) -> None:
        """Drop the partial shard: nothing is left under a final name."""
        try:
            self._tar.close()
        finally:
            self._file.close()
            for tmp in (self._tmp, self._tmp_index):
                tmp.unlink(missing_ok=True)


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
