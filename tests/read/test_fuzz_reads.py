"""Fuzz the read side with seeded mutations of a small, valid shard folder.

Each case copies a tiny dataset (40 raw 8x8 samples, or 12 PNG samples; label == sample id, as
in `unique_label_source`), applies 1-3 mutations (bytes flipped, inserted, deleted, overwritten
or cut off in a .tar, .idx, .sum or manifest.json; JSON-aware edits of the manifest: wrong types,
negative and huge numbers, missing keys, paths with '..' or absolute), then reads the whole train
split with the cpu backend (num_workers=0) and the memory backend, each with the default checks
and with `verify_samples=True`, and runs `fastdata verify` and `fastdata inspect` on the folder.

Every case must end within its time limit with, for each read, either

- a clear error: one of `ACCEPTED` (fastdata's own types), whose message names the dataset
  folder or one of its files; a bare KeyError / IndexError / struct.error / UnicodeDecodeError
  (or a ValueError that names no file) fails the test; or
- data equal to the original: every sample exactly once, its pixels and label those written.

The exception to "equal to the original", by design: with the default checks (no
verify_samples), a mutation inside the payload bytes of a component (pixels, label, class text)
is not detected (the tar headers, index checksum and label range are checked; the payload is
not). For a case that changed payload bytes, a read with the default checks (or with
verify_samples when the manifest no longer lists the digest files) only has to deliver every
row with a label in range and the right shape.

`fastdata verify` / `fastdata inspect` must return 0 or 1 and never raise; `verify` must return
1 when the manifest is unchanged and a shard, index or digest file's bytes changed. No case may
write a file outside its own cache folders. FASTDATA_FUZZ_CASES=N runs N cases (default 150, ~10 s);
FASTDATA_FUZZ_SEED picks the seed (default 0; a failure prints the case, seed and mutations).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastdata import cli
from fastdata.format.integrity import IntegrityError
from fastdata.format.manifest import ManifestError
from fastdata.format.manifest_io import load_manifest
from fastdata.read.backends import memory
from fastdata.read.backends.cpu import make_cpu_loader
from fastdata.read.backends.memory import make_memory_loader
from fastdata.read.base import LoaderSpec
from fastdata.read.plan import PAD_LABEL
from fastdata.read.resume import ResumeError
from fastdata.read.shardio import ShardReadError
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources.arrays import ArraySource
from tests.conftest import unique_label_source
from tests.write.test_fuzz_lists import _time_limit

CASES = int(os.environ.get("FASTDATA_FUZZ_CASES", "150"))
SEED = int(os.environ.get("FASTDATA_FUZZ_SEED", "0"))
CASE_TIMEOUT_S = 60  # generous: a case takes a fraction of a second; a hang is what this catches

#: What a read of an untrusted folder may raise (all ValueError or RuntimeError subclasses).
ACCEPTED = (ManifestError, ShardReadError, IntegrityError, ResumeError, ValueError)

_ODD_VALUES: list[Any] = [-1, 0, 2**64, 10**40, 1.5, float("nan"), "7", "", None, True, [], {}]
_ODD_VALUES += [[1, 2], {"a": 1}, "x" * 300]
_ODD_PATHS = ["../outside.tar", "/etc/hostname", "a/../../x.tar", "..", "C:\\x.tar", "%2e%2e/x"]
_ODD_PATHS += ["train-000000.tar/", "", "train-000001.tar", "test-000000.idx", "nope.tar"]


# ----------------------------------------------------------------------------- the datasets


def _png_source() -> ArraySource:
    pixels = np.random.default_rng(3).integers(0, 256, (12, 8, 8, 3), dtype=np.uint8)
    classes = [f"c{i}" for i in range(12)]
    return ArraySource(
        {"train": (pixels, np.arange(12)), "test": (pixels[:3], np.arange(3))}, classes
    )


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, np.ndarray]]:
    """name -> (folder, original train pixels by sample id, N x 3 x 8 x 8)."""
    root = tmp_path_factory.mktemp("fuzz-bases")
    raw, png = unique_label_source(n_train=40, n_test=8), _png_source()
    write_shards(raw, root / "raw", ShardOptions(max_count=16, workers=1, progress=False))
    write_shards(
        png, root / "png", ShardOptions(max_count=5, workers=1, progress=False, encoding="png")
    )
    out = {}
    for name, source in (("raw", raw), ("png", png)):
        n = source.splits()["train"]
        pixels = np.stack([source.item("train", i).pixels for i in range(n)])
        out[name] = (root / name, pixels.transpose(0, 3, 1, 2).copy())
    return out


# ----------------------------------------------------------------------------- mutations


def _payload_ranges(folder: Path) -> dict[str, list[tuple[int, int]]]:
    """tar name -> (offset, size) of every component, from the original indexes."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for index in sorted(folder.glob("*.idx")):
        fields = index.read_text().split()[2:]
        tar = index.with_suffix(".tar").name
        ranges[tar] = [(int(fields[i + 1]), int(fields[i + 2])) for i in range(0, len(fields), 4)]
    return ranges


def _mutate_bytes(
    data: bytes, rng: random.Random, ranges: list[tuple[int, int]]
) -> tuple[bytes, str]:
    """One byte-level mutation; tar offsets favour headers and payloads over padding."""
    if not data:
        return b"\x00", "wrote 1 byte into an empty file"
    at = rng.randrange(len(data))
    if ranges and rng.random() < 0.7:
        offset, size = rng.choice(ranges)
        at = (
            offset + rng.randrange(size)
            if rng.random() < 0.6
            else offset - 512 + rng.randrange(512)
        )
        at = min(max(at, 0), len(data) - 1)
    kind = rng.choice(["flip", "flip", "insert", "delete", "truncate", "overwrite", "digit"])
    if kind == "flip":
        mask = 1 << rng.randrange(8)
        return data[:at] + bytes([data[at] ^ mask]) + data[at + 1 :], f"flip bit {mask:#x} at {at}"
    if kind == "insert":
        junk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 3, 512])))
        return data[:at] + junk + data[at:], f"insert {len(junk)} bytes at {at}"
    if kind == "delete":
        n = rng.choice([1, 7, 512])
        return data[:at] + data[at + n :], f"delete {n} bytes at {at}"
    if kind == "truncate":
        return data[:at], f"truncate at {at}"
    if kind == "overwrite":
        n = rng.choice([1, 4, 16])
        fill = bytes([rng.choice([0, 0xFF, 0x20, 0x30])]) * n
        return data[:at] + fill + data[at + n :], f"overwrite {n} bytes at {at} with {fill[:1]!r}"
    digit = str(rng.randrange(10)).encode()  # text files: a number changed to another number
    return data[:at] + digit + data[at + 1 :], f"digit {digit!r} at {at}"


def _json_paths(value: Any, path: tuple = ()) -> list[tuple]:
    paths = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += _json_paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value[:3]):
            paths += _json_paths(item, (*path, i))
    return paths


def _mutate_json(data: Any, rng: random.Random) -> str:
    """One JSON-aware edit of the parsed manifest, in place; says what it did."""
    splits = data.get("splits") if isinstance(data, dict) else None
    shards = [
        s
        for sp in (splits.values() if isinstance(splits, dict) else [])
        if isinstance(sp, dict) and isinstance(sp.get("shards"), list)
        for s in sp["shards"]
        if isinstance(s, dict)
    ]
    if shards and rng.random() < 0.3:
        shard, key = rng.choice(shards), rng.choice(["name", "index", "sums"])
        shard[key] = rng.choice(_ODD_PATHS)
        return f"shard {key} = {shard[key]!r}"
    paths = _json_paths(data)[1:]
    if not paths:
        return "nothing to edit"
    path = rng.choice(paths)
    parent = data
    for step in path[:-1]:
        parent = parent[step]
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[path[-1]]
        return f"delete {path}"
    parent[path[-1]] = rng.choice(_ODD_VALUES)
    return f"set {path} = {parent[path[-1]]!r}"[:200]


def _mutate(
    folder: Path, rng: random.Random, ranges: dict[str, list[tuple[int, int]]]
) -> list[str]:
    done = []
    for _ in range(rng.randint(1, 3)):
        files = sorted(p for p in folder.iterdir() if p.is_file())
        target = rng.choice(files + [folder / "manifest.json"] * 3)
        if target.name == "manifest.json" and rng.random() < 0.6:
            try:
                data = json.loads(target.read_text())
            except (ValueError, UnicodeDecodeError):
                continue
            done.append(f"manifest.json: {_mutate_json(data, rng)}")
            target.write_text(json.dumps(data))
            continue
        if not target.exists():
            continue
        data, what = _mutate_bytes(target.read_bytes(), rng, ranges.get(target.name, []))
        target.write_bytes(data)
        done.append(f"{target.name}: {what}")
    return done


# ----------------------------------------------------------------------------- the oracle


def _payload_changed(
    original: Path, folder: Path, ranges: dict[str, list[tuple[int, int]]]
) -> bool:
    for tar, spans in ranges.items():
        before, after = (original / tar).read_bytes(), (folder / tar).read_bytes()
        if any(before[o : o + n] != after[o : o + n] for o, n in spans):
            return True
    return False


def _digests_listed(original: Path, folder: Path) -> bool:
    """Whether the mutated manifest still lists every shard's digest file as the original does."""
    try:
        data = json.loads((folder / "manifest.json").read_text())
        shards = data["splits"]["train"]["shards"]
        want = json.loads((original / "manifest.json").read_text())["splits"]["train"]["shards"]
        return [(s.get("sums"), s.get("sums_sha256")) for s in shards] == [
            (s["sums"], s["sums_sha256"]) for s in want
        ]
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return True  # the manifest does not load: the read must fail anyway


def _read(folder: Path, backend: str, verify: bool, cache: Path) -> list[tuple[np.ndarray, int]]:
    memory.clear_device_cache()
    spec = LoaderSpec(
        manifest=load_manifest(folder), split="train", train=False, batch_size=16,
        decoded_cache_dir=str(cache), verify_samples=verify,
    )  # fmt: skip
    loader = (make_cpu_loader if backend == "cpu" else make_memory_loader)(spec)
    rows = []
    for x, y in loader:
        rows += [(x[i].numpy(), int(y[i])) for i in range(len(y)) if int(y[i]) != PAD_LABEL]
    return rows


def _check_rows(rows: list[tuple[np.ndarray, int]], pixels: np.ndarray, exact: bool) -> None:
    labels = [label for _, label in rows]
    assert len(rows) == len(pixels), f"{len(rows)} rows delivered, {len(pixels)} written"
    assert all(0 <= label < len(pixels) for label in labels), f"labels out of range: {labels}"
    assert all(x.shape == pixels.shape[1:] for x, _ in rows), "a wrong image shape delivered"
    if exact:
        assert sorted(labels) == list(range(len(pixels))), f"labels differ: {sorted(labels)}"
        wrong = [label for x, label in rows if not np.array_equal(x, pixels[label])]
        assert not wrong, f"wrong pixels delivered without an error for samples {wrong}"


def _clear(exc: BaseException, folder: Path) -> bool:
    """A fastdata error naming the folder or one of its files. Also accepted: the usage error
    a valid folder of photos gives too (no common size, no image_size), which says what to do."""
    text = str(exc)
    named = str(folder) in text or any(p.name in text for p in folder.iterdir())
    return isinstance(exc, ACCEPTED) and (named or "pass image_size" in text)


def _cli(args: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return cli.main(args)


def _tree(root: Path) -> set[str]:
    return {os.path.join(d, name) for d, dirs, files in os.walk(root) for name in dirs + files}


def _run_case(case: int, bases, work: Path, outcomes: dict[str, int], done: list[str]) -> None:
    rng = random.Random(f"{SEED}-{case}")
    name = "png" if rng.random() < 0.3 else "raw"
    original, pixels = bases[name]
    ranges = _payload_ranges(original)
    folder = work / f"{case:05d}" / name
    shutil.copytree(original, folder)
    done += [f"{name} dataset", *_mutate(folder, rng, ranges)]
    payload = _payload_changed(original, folder, ranges)
    digests = _digests_listed(original, folder)
    manifest_same = (folder / "manifest.json").read_bytes() == (
        original / "manifest.json"
    ).read_bytes()
    files_changed = any(
        (folder / p.name).read_bytes() != p.read_bytes() if (folder / p.name).exists() else True
        for p in original.iterdir()
    )
    errors = 0
    for backend in ("cpu", "memory"):
        for verify in (False, True):
            mode = f"{backend}{'+verify' if verify else ''}"
            try:
                rows = _read(folder, backend, verify, work / f"{case:05d}" / f"cache-{mode}")
            except Exception as exc:  # noqa: BLE001 - the oracle decides
                assert _clear(exc, folder), f"{mode}: unclear error {type(exc).__name__}: {exc}"
                outcomes["error"] += 1
                errors += 1
                continue
            exact = not payload or (verify and digests)
            _check_rows(rows, pixels, exact)
            outcomes["ok" if exact else "ok, payload changed: labels and shapes checked"] += 1
    verified = _cli(["verify", str(folder), "--no-progress"])
    assert verified in (0, 1), f"fastdata verify returned {verified}"
    assert verified == 1 or not (manifest_same and files_changed), "verify missed a changed file"
    inspected = _cli(["inspect", str(folder)])
    assert inspected in (0, 1), f"fastdata inspect returned {inspected}"
    allowed = {name} | {f"cache-{b}{v}" for b in ("cpu", "memory") for v in ("", "+verify")}
    assert {p.name for p in folder.parent.iterdir()} <= allowed, "a case wrote outside OUT"


def test_fuzzed_shard_folders_read_correctly_or_fail_clearly(bases, tmp_path: Path) -> None:
    outcomes = {"ok": 0, "error": 0, "ok, payload changed: labels and shapes checked": 0}
    before = {name: _tree(folder) for name, (folder, _) in bases.items()}
    env_cache = Path(os.environ["FASTDATA_CACHE_DIR"])  # conftest: a fresh folder per test
    for case in range(CASES):
        done: list[str] = []
        try:
            with _time_limit(CASE_TIMEOUT_S):
                _run_case(case, bases, tmp_path, outcomes, done)
        except BaseException as exc:
            raise AssertionError(
                f"fuzz case {case} (seed {SEED}) failed: {exc!r}\n  mutations: {done}"
            ) from exc
        shutil.rmtree(tmp_path / f"{case:05d}")
        assert not list(tmp_path.iterdir()), f"case {case} wrote {list(tmp_path.iterdir())}"
        assert not list(env_cache.iterdir()), f"case {case} wrote into {env_cache}"
    for name, (folder, _) in bases.items():
        assert _tree(folder) == before[name], f"a read wrote into the {name} dataset"
    print(f"fuzz outcomes over {CASES} cases (seed {SEED}): {outcomes}")
    assert outcomes["ok"] and outcomes["error"], outcomes


# ----------------------------------------------------------------------------- what it found


def _drop_last_shard(data: dict) -> None:
    data["splits"]["train"]["shards"].pop()


def _set_shard(field_name: str, value: Any):
    return lambda data: data["splits"]["train"]["shards"][0].update({field_name: value})


def _set_split(field_name: str, value: Any):
    return lambda data: data["splits"]["train"].update({field_name: value})


def _drop_split_field(field_name: str):
    return lambda data: data["splits"]["train"].pop(field_name)


#: Manifest edits the fuzzer found reaching a reader unrefused (seed/case in each comment), each
#: then failing deep inside with a bare error, or delivering a short split without one.
FOUND = {
    "raw_shape_huge": ("png", _set_split("raw_shape", [8, 10**40, 3]), "raw_shape"),  # 0/111
    "name_trailing_slash": ("raw", _set_shard("name", "train-000000.tar/"), "empty path"),  # 0/166
    "name_null": ("raw", _set_shard("name", None), "name: file name must be"),  # 0/272
    "raw_without_shape": ("raw", _drop_split_field("raw_shape"), "has no raw_shape"),  # 0/740
    "num_samples_huge": ("png", _set_shard("num_samples", 10**40), "cannot fit"),  # 1/1924
    "sha256_not_hex": ("raw", _set_shard("sha256", "0" * 100), "is not a hex sha256"),  # 1/2609
    "shard_entry_lost": ("raw", _drop_last_shard, "add up to 40 samples, its shards list 32"),
    "sums_name_too_long": ("png", _set_shard("sums", "x" * 300), "cannot be looked up"),  # 1/2837
}


@pytest.mark.parametrize("case", sorted(FOUND))
def test_manifest_edits_the_fuzzer_found_are_refused_at_load(bases, tmp_path, case) -> None:
    name, edit, message = FOUND[case]
    folder = tmp_path / name
    shutil.copytree(bases[name][0], folder)
    data = json.loads((folder / "manifest.json").read_text())
    edit(data)
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=re.escape(message)) as caught:
        load_manifest(folder)
    assert str(folder) in str(caught.value)


def test_a_manifest_that_is_not_utf8_is_a_manifest_error(bases, tmp_path) -> None:
    """Found by seed 0, case 4: a byte inserted into manifest.json raised UnicodeDecodeError."""
    folder = tmp_path / "raw"
    shutil.copytree(bases["raw"][0], folder)
    text = (folder / "manifest.json").read_bytes()
    (folder / "manifest.json").write_bytes(text[:100] + b"\xce\xff" + text[100:])
    with pytest.raises(ManifestError, match=r"manifest\.json is not valid UTF-8 JSON"):
        load_manifest(folder)
    (folder / "manifest.json").write_bytes(b"[" * 100_000)  # nesting past the recursion limit
    with pytest.raises(ManifestError, match="is not valid UTF-8 JSON"):
        load_manifest(folder)
