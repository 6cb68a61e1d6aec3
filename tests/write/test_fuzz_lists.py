"""Fuzz the list-file source and the writer with seeded mutations of valid list files.

Every case must end within its time limit with either a correct output (a manifest accounting
for every listed row) or a clear error (a `fastdata` exception naming the list file), and must
never write a file outside OUT. FASTDATA_FUZZ_CASES=N runs N cases (default 40);
FASTDATA_FUZZ_SEED picks the seed (default 0; a failure prints the case's seed and list file).
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata.write import ShardingError, ShardOptions, write_shards
from fastdata.write.sources import BadSourceError, ListSource

CASES = int(os.environ.get("FASTDATA_FUZZ_CASES", "40"))
SEED = int(os.environ.get("FASTDATA_FUZZ_SEED", "0"))
CASE_TIMEOUT_S = 60  # generous: a case takes well under a second; a hang is what this catches
OPTS = ShardOptions(max_count=3, workers=1, progress=False, max_bad=0.5)

_SPLITS = ["train", "val", "", "../escaped", "/abs/path", "a/b", "..", ".", "x.y", "sp ace"]
_SPLITS += ["-lead", "é", "a" * 80, "../../../../tmp/evil", "train\x00x", "C:\\win"]
_LABELS = ["0", "1", "2", "-1", "99999999999", "9" * 5000, "1.5", "cat", "", " 3 ", "+2", "0x10"]
_PATHS = ["img/0.png", "img/1.png", "img/2.png", "img/missing.png", "../outside.png", "/dev/zero"]
_PATHS += ["img", "img/fifo.png", "img/../img/0.png", "a" * 5000 + ".png", "img/0.png\x00.jpg"]
_PATHS += ["img/not-an-image.png", "img/huge-header.png"]


class CaseTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def fail(signum: int, frame: object) -> None:
        raise CaseTimeout(f"case did not end within {seconds} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-images")
    (root / "img").mkdir()
    for i in range(3):
        Image.fromarray(np.full((6, 5, 3), i * 60, np.uint8)).save(root / "img" / f"{i}.png")
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / "outside.png")
    (root / "img" / "not-an-image.png").write_text("<html>404</html>")
    header = bytearray((root / "img" / "0.png").read_bytes())
    header[16:24] = (20_000).to_bytes(4, "big") * 2  # IHDR says 20000 x 20000 (bad CRC too)
    (root / "img" / "huge-header.png").write_bytes(bytes(header))
    os.mkfifo(root / "img" / "fifo.png")  # reading it would block forever
    return root


def _rows(rng: random.Random) -> list[list[str]]:
    rows = [[f"img/{i % 3}.png", str(i % 3), rng.choice(["train", "val", ""])] for i in range(6)]
    for _ in range(rng.randint(0, 3)):
        row = rng.choice(rows)
        column = rng.randrange(3)
        row[column] = rng.choice([_PATHS, _LABELS, _SPLITS][column])
    return rows


def _csv_text(rows: list[list[str]], rng: random.Random) -> str:
    lines = ["path,label,split"] + [",".join(row) for row in rows]
    mutation = rng.randrange(8)
    if mutation == 0:
        lines.insert(rng.randrange(1, len(lines) + 1), "")  # an empty row
    elif mutation == 1:
        lines[rng.randrange(1, len(lines))] += ",extra"
    elif mutation == 2:
        lines[rng.randrange(1, len(lines))] = '"unbalanced,0'
    elif mutation == 3:
        lines = lines[1:]  # no header
    elif mutation == 4:
        lines[0] = "path,label,split,path"
    return "\r\n".join(lines) if rng.random() < 0.3 else "\n".join(lines) + "\n"


def _jsonl_text(rows: list[list[str]], rng: random.Random) -> str:
    lines = []
    for path, label, split in rows:
        record: dict[str, object] = {"path": path, "label": label}
        if split:
            record["split"] = split
        text = json.dumps(record)
        if label.isdigit():  # a JSON number, however long (int() refuses 4300+ digits)
            text = text.replace(f'"label": "{label}"', f'"label": {label}')
        lines.append(text)
    mutation = rng.randrange(6)
    if mutation == 0:
        lines.append("[" * 50_000)
    elif mutation == 1:
        lines.append('{"path": "img/0.png", "label": NaN}')
    elif mutation == 2:
        lines.append('{"path": ["img/0.png"], "label": true, "split": 3}')
    elif mutation == 3:
        lines.append('{"path": "img/0.png", "label": ' + "7" * 30 + "}")
    return "\n".join(lines) + "\n"


def _encode(text: str, rng: random.Random) -> bytes:
    """The list's bytes, sometimes in an encoding it must not be read in, or with a NUL."""
    choice = rng.randrange(10)
    if choice == 0:
        return text.replace("img/1", "img/\xe91").encode("latin-1", "replace")
    if choice == 1:
        return text.encode("utf-16")
    if choice == 2:
        data = text.encode("utf-8", "surrogatepass")
        at = rng.randrange(len(data))
        return data[:at] + b"\x00" + data[at:]
    if choice == 3:
        return b"\xef\xbb\xbf" + text.encode("utf-8", "surrogatepass")
    return text.encode("utf-8", "replace")


def _tree(folder: Path, skip: Path) -> set[str]:
    found = set()
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        found |= {os.path.join(dirpath, name) for name in filenames + dirnames}
    return found


def _run_case(lst: Path, out: Path) -> str:
    """'ok' or 'error'; raises (failing the test) for anything else."""
    try:
        source = ListSource(lst)
    except BadSourceError as exc:
        assert str(lst) in str(exc), f"error does not name the list file: {exc}"
        return "error"
    try:
        manifest = write_shards(source, out, OPTS)
    except ShardingError as exc:  # includes TooManyBadSamplesError and FolderLockedError
        assert lst.name in str(exc) or str(out) in str(exc), f"unclear error: {exc}"
        assert not (out / "manifest.json").exists()
        return "error"
    listed = sum(source.splits().values())
    for name, split in manifest.splits.items():
        assert split.num_samples + len(split.skipped) == source.splits()[name]
        for shard in split.shards:
            assert (out / shard.name).is_file() and (out / shard.index).is_file()
    assert sum(s.num_samples + len(s.skipped) for s in manifest.splits.values()) == listed
    return "ok"


def _case_makers() -> list[Callable[[random.Random], tuple[str, bytes]]]:
    return [
        lambda rng: ("list.csv", _encode(_csv_text(_rows(rng), rng), rng)),
        lambda rng: ("list.jsonl", _encode(_jsonl_text(_rows(rng), rng), rng)),
    ]


def test_fuzzed_list_files_end_cleanly_and_write_only_into_out(images: Path) -> None:
    outcomes = {"ok": 0, "error": 0}
    makers = _case_makers()
    for case in range(CASES):
        rng = random.Random(f"{SEED}-{case}")
        name, data = makers[case % len(makers)](rng)
        folder = images / "cases" / f"{case:04d}"
        folder.mkdir(parents=True)
        lst = images / f"{case:04d}-{name}"  # beside img/: its relative paths resolve there
        lst.write_bytes(data)
        out = folder / "sub" / "out"
        before = _tree(images, out) | {str(lst)}
        try:
            with _time_limit(CASE_TIMEOUT_S):
                outcomes[_run_case(lst, out)] += 1
        except BaseException as exc:
            raise AssertionError(
                f"fuzz case {case} (seed {SEED}, list {lst}) failed: {exc!r}"
            ) from exc
        created = _tree(images, out) - before - {str(folder / "sub"), str(out)}
        assert not created, f"case {case} wrote outside OUT: {sorted(created)[:5]}"
    print(f"fuzz outcomes over {CASES} cases (seed {SEED}): {outcomes}")
    # The mutations are meant to reach both ends; a generator that only makes errors tests little.
    assert outcomes["ok"] and outcomes["error"], outcomes
