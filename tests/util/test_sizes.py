"""One size grammar: the CLI's flags, `CacheSettings(limit=)` and `$FASTDATA_CACHE_LIMIT` read
a size text as the same number of bytes (`fastdata._util.sizes.parse_size`)."""

from __future__ import annotations

import pytest

from fastdata._util.sizes import parse_size
from fastdata.cli import build_parser, main

SIZES = [
    ("1000", 1000),
    ("7B", 7),
    ("10k", 10**4),
    ("500MB", 500 * 10**6),
    ("500M", 500 * 10**6),
    ("1G", 10**9),
    ("1gb", 10**9),
    ("1.5T", 1_500_000_000_000),
    (" 3 GB ", 3 * 10**9),
    ("512MiB", 512 * 2**20),
    ("512Mi", 512 * 2**20),
    ("1GiB", 2**30),
    ("2gi", 2 * 2**30),
    ("0.5KiB", 512),
]


@pytest.mark.parametrize(("text", "expected"), SIZES)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "12 parsecs", "-5GB", "5i", "1e3", "5KBB", "1.2.3"])
def test_what_is_not_a_size_is_refused_everywhere(text: str, capsys) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)
    with pytest.raises(SystemExit):
        main(["shard", "folder", "in", "out", f"--max-size={text}"])
    assert "not a size" in capsys.readouterr().err


def _cli_bytes(flag: str, text: str, source: str = "folder") -> int:
    paths = ["images", "annotations.json"] if source == "coco" else ["in"]
    args = build_parser(features=False).parse_args(["shard", source, *paths, "out", flag, text])
    return getattr(args, flag.removeprefix("--").replace("-", "_"))


@pytest.mark.parametrize(("text", "expected"), SIZES)
def test_every_size_text_is_the_same_bytes_through_cli_settings_and_environment(
    text: str, expected: int, tmp_path, monkeypatch
) -> None:
    pytest.importorskip("fsspec")
    from fastdata.lightning.options import CacheSettings, shard_cache
    from fastdata.remote import ShardCache

    remote = ["http://127.0.0.1:9/dataset"]
    through = {
        "--max-size": _cli_bytes("--max-size", text),
        "--max-json-bytes": _cli_bytes("--max-json-bytes", text, "coco"),
        "CacheSettings": shard_cache(remote, CacheSettings(dir=tmp_path, limit=text)).limit_bytes,
    }
    monkeypatch.setenv("FASTDATA_CACHE_LIMIT", text)
    monkeypatch.setenv("FASTDATA_CACHE_DIR", str(tmp_path))
    through["$FASTDATA_CACHE_LIMIT"] = ShardCache.default().limit_bytes
    through["CacheSettings(dir) + env"] = shard_cache(
        remote, CacheSettings(dir=tmp_path)
    ).limit_bytes
    assert through == dict.fromkeys(through, expected)
