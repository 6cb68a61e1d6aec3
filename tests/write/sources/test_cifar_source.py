"""CifarSource on tiny fake archives in the official layout, on downloads from a local server,
and on the real CIFAR-100 archive."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fastdata.write.sources import BadSourceError, CifarSource, Source, open_source
from fastdata.write.sources import cifar as cifar_module
from fastdata.write.sources.download import DownloadError
from fastdata.write.sources.safe_pickle import UnsafePickleError
from fastdata.write.sources.safe_tar import UnsafeArchiveError

FakeBuilder = Callable[..., object]


def _check_matches(src: Source, fake: object, label_key: str) -> None:
    """Every item of `src` equals the arrays the fake archive was built from."""
    assert src.splits() == {s: len(p) for s, p in fake.pixels.items()}
    for split, pixels in fake.pixels.items():
        for i in range(len(pixels)):
            item = src.item(split, i)
            assert item.sample_id == i and item.path is None
            assert item.pixels.shape == (32, 32, 3) and item.pixels.dtype == np.uint8
            assert item.pixels.flags["C_CONTIGUOUS"]
            np.testing.assert_array_equal(item.pixels, pixels[i])
            assert item.label == fake.labels[label_key][split][i]


@pytest.mark.parametrize("compression", ["gz", ""])
def test_cifar100_archive(tmp_path: Path, fake_cifar: FakeBuilder, compression: str) -> None:
    fake = fake_cifar(tmp_path, "cifar100", compression=compression)
    src = open_source("cifar100", fake.path)
    assert isinstance(src, Source) and src.kind == "cifar100"
    assert src.classes == fake.names["fine_label_names"]
    _check_matches(src, fake, "fine_labels")
    assert src.item("train", 7).origin == f"{fake.path.name}:cifar-100-python/train[7]"
    assert sorted(p.name for p in tmp_path.iterdir()) == [fake.path.name]  # nothing extracted


def test_source_survives_pickling(tmp_path: Path, fake_cifar: FakeBuilder) -> None:
    # Writer workers may be spawned rather than forked: the source must travel by pickle.
    fake = fake_cifar(tmp_path, "cifar10", n_train=10, n_test=5)
    _check_matches(
        pickle.loads(pickle.dumps(CifarSource(fake.path, kind="cifar10"))), fake, "labels"
    )


def test_cifar100_coarse_labels(tmp_path: Path, fake_cifar: FakeBuilder) -> None:
    fake = fake_cifar(tmp_path, "cifar100")
    src = CifarSource(fake.path, label="coarse")
    assert src.classes == fake.names["coarse_label_names"]
    _check_matches(src, fake, "coarse_labels")


def test_cifar10_archive_concatenates_batches(tmp_path: Path, fake_cifar: FakeBuilder) -> None:
    fake = fake_cifar(tmp_path, "cifar10", n_train=20, n_test=6)
    src = open_source("cifar10", fake.path)
    assert src.kind == "cifar10" and src.classes == fake.names["label_names"]
    _check_matches(src, fake, "labels")
    # 20 rows in 5 batches of 4: row 9 is the second of data_batch_3.
    assert src.item("train", 9).origin.endswith("cifar-10-batches-py/data_batch_3[1]")
    with pytest.raises(ValueError, match="coarse"):
        CifarSource(fake.path, kind="cifar10", label="coarse")


@pytest.mark.parametrize("which", ["folder", "parent"])
def test_extracted_folder(tmp_path: Path, fake_cifar: FakeBuilder, which: str) -> None:
    fake = fake_cifar(tmp_path / "x", "cifar100", extracted=True)
    src = CifarSource(fake.path if which == "folder" else fake.path.parent)
    _check_matches(src, fake, "fine_labels")
    assert src.item("test", 2).origin == f"{fake.path / 'test'}[2]"
    sizes = src.fingerprint()["members"]
    assert sizes == {n: (fake.path / n).stat().st_size for n in ("train", "test", "meta")}


def test_fingerprint_tracks_the_archive(tmp_path: Path, fake_cifar: FakeBuilder) -> None:
    fake = fake_cifar(tmp_path, "cifar100")
    first = CifarSource(fake.path).fingerprint()
    assert first == CifarSource(fake.path).fingerprint()
    assert first["path"] == str(fake.path.resolve()) and first["kind"] == "cifar100"
    assert first["bytes"] == fake.path.stat().st_size
    os.utime(fake.path, ns=(0, 10**18))
    assert CifarSource(fake.path).fingerprint() != first
    assert CifarSource(fake.path, label="coarse").fingerprint()["label"] == "coarse"


def test_item_bounds(tmp_path: Path, fake_cifar: FakeBuilder) -> None:
    src = CifarSource(fake_cifar(tmp_path, "cifar100").path)
    with pytest.raises(IndexError, match="train\\[20\\]"):
        src.item("train", 20)
    with pytest.raises(ValueError, match="'val'"):
        src.item("val", 0)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cifar1000"):
        CifarSource(tmp_path, kind="cifar1000")
    with pytest.raises(ValueError, match="download=True"):
        CifarSource(None)
    with pytest.raises(BadSourceError, match="no such file"):
        CifarSource(tmp_path / "absent.tar.gz")


def test_missing_member_names_the_layout(tmp_path: Path) -> None:
    archive = tmp_path / "partial.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = pickle.dumps({"fine_label_names": ["a"], "coarse_label_names": ["b"]})
        info = tarfile.TarInfo("cifar-100-python/meta")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(
        BadSourceError, match="missing cifar-100-python/train, cifar-100-python/test"
    ):
        CifarSource(archive)


def test_malicious_pickle_in_archive_is_not_run(tmp_path: Path, fake_cifar: FakeBuilder) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {marker}",)

    fake = fake_cifar(tmp_path / "a", "cifar100")
    with tarfile.open(fake.path, "r:gz") as tar:  # rebuild with an evil "test" member
        members = {m.name: tar.extractfile(m).read() for m in tar}
    members["cifar-100-python/test"] = pickle.dumps({"data": Evil()}, protocol=2)
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(UnsafePickleError, match="evil.tar.gz:cifar-100-python/test"):
        CifarSource(evil)
    assert not marker.exists()


def test_traversal_member_is_refused(tmp_path: Path, fake_cifar: FakeBuilder) -> None:
    fake = fake_cifar(tmp_path / "a", "cifar100", extra_members={"../../escape": b"x"})
    with pytest.raises(UnsafeArchiveError, match="'../../escape'"):
        CifarSource(fake.path)
    assert not (tmp_path / "escape").exists() and not (tmp_path.parent / "escape").exists()


def test_wrong_data_shape_is_a_bad_source(tmp_path: Path) -> None:
    archive = tmp_path / "odd.tar"
    batch = {"data": np.zeros((4, 100), np.uint8), "fine_labels": [0] * 4, "coarse_labels": [0] * 4}
    files = {
        "meta": {"fine_label_names": ["a"], "coarse_label_names": ["b"]},
        "train": batch,
        "test": batch,
    }
    with tarfile.open(archive, "w") as tar:
        for name, obj in files.items():
            data = pickle.dumps(obj, protocol=3)
            info = tarfile.TarInfo(f"cifar-100-python/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BadSourceError, match="odd.tar:cifar-100-python/train: 'data' must be"):
        CifarSource(archive)


# ---- download ------------------------------------------------------------------------------


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_download_end_to_end(
    tmp_path: Path, fake_cifar: FakeBuilder, http_server: tuple[str, Path]
) -> None:
    url, served = http_server
    fake = fake_cifar(served, "cifar100")
    cache = tmp_path / "cache"
    src = CifarSource(
        None,
        download=True,
        cache_dir=cache,
        url=f"{url}/{fake.path.name}",
        md5=_md5(fake.path),
        progress=False,
    )
    _check_matches(src, fake, "fine_labels")
    assert src.path == cache / "cifar-100-python.tar.gz"
    assert src.path.read_bytes() == fake.path.read_bytes()
    # A verified file in the cache is used as is: an unreachable URL is never tried.
    again = CifarSource(
        None,
        download=True,
        cache_dir=cache,
        url=f"{url}/gone",
        md5=_md5(fake.path),
        progress=False,
    )
    assert again.splits() == src.splits()


def test_download_uses_the_overridable_default_url(
    tmp_path: Path,
    fake_cifar: FakeBuilder,
    http_server: tuple[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, served = http_server
    fake = fake_cifar(served, "cifar10", n_train=10, n_test=5)
    monkeypatch.setitem(
        cifar_module.DOWNLOADS, "cifar10", (f"{url}/{fake.path.name}", _md5(fake.path))
    )
    src = open_source("cifar10", None, download=True, cache_dir=tmp_path / "c", progress=False)
    _check_matches(src, fake, "labels")


def test_download_with_wrong_md5_keeps_nothing(
    tmp_path: Path, fake_cifar: FakeBuilder, http_server: tuple[str, Path]
) -> None:
    url, served = http_server
    fake = fake_cifar(served, "cifar100")
    cache = tmp_path / "cache"
    with pytest.raises(DownloadError, match="checksum mismatch"):
        CifarSource(
            None, download=True, cache_dir=cache, url=f"{url}/{fake.path.name}", progress=False
        )  # the official MD5 cannot match the fake archive
    assert list(cache.iterdir()) == []


def test_local_file_needs_no_official_md5(tmp_path: Path, fake_cifar: FakeBuilder) -> None:
    fake = fake_cifar(tmp_path, "cifar100")
    assert _md5(fake.path) != cifar_module.DOWNLOADS["cifar100"][1]
    # download=True does not override a local input, nor check it against the official MD5.
    assert CifarSource(fake.path, download=True).splits() == {"train": 20, "test": 10}


# ---- real data ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_cifar100(real_data: Path) -> tuple[Source, dict[str, dict]]:
    archive = real_data / "cifar-100-python.tar.gz"
    if not archive.is_file():
        pytest.skip(f"{archive} is absent")
    # Decoded independently of fastdata: the plain pickle module on a trusted file.
    # Stream mode: one pass over the gzip stream (random access would decompress it 3 times).
    with tarfile.open(archive, "r|gz") as tar:
        raw = {
            member.name.split("/")[-1]: pickle.load(tar.extractfile(member), encoding="latin1")
            for member in tar
            if member.name in ("cifar-100-python/train", "cifar-100-python/test")
        }
    return open_source("cifar100", archive), raw


@pytest.mark.realdata
def test_real_cifar100(real_cifar100: tuple[Source, dict[str, dict]]) -> None:
    src, raw = real_cifar100
    assert src.splits() == {"train": 50000, "test": 10000}
    assert len(src.classes) == 100 and src.classes[:2] == ["apple", "aquarium_fish"]
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 500), ("test", 100)):
        count = src.splits()[split]
        labels = np.array([src.item(split, i).label for i in range(count)])
        np.testing.assert_array_equal(labels, raw[split]["fine_labels"])
        assert np.bincount(labels, minlength=100).tolist() == [per_class] * 100
        for i in [0, count - 1, *rng.integers(0, count, 50)]:
            row = raw[split]["data"][i]
            expected = row.reshape(3, 32, 32).transpose(1, 2, 0)
            np.testing.assert_array_equal(src.item(split, int(i)).pixels, expected)
