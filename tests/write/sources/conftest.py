"""Fixtures for the source tests: tiny fake CIFAR archives in the official layout, a local HTTP
server, and the real data folder (skipped when absent)."""

from __future__ import annotations

import http.server
import io
import pickle
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from fastdata_pipelines.env import data_dir

# kind -> (top folder, split -> batch files, meta file, label keys, name keys)
_FAKE_LAYOUTS = {
    "cifar100": (
        "cifar-100-python",
        {"train": ["train"], "test": ["test"]},
        "meta",
        {"fine_labels": 5, "coarse_labels": 2},
        {"fine_label_names": 5, "coarse_label_names": 2},
    ),
    "cifar10": (
        "cifar-10-batches-py",
        {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]},
        "batches.meta",
        {"labels": 4},
        {"label_names": 4},
    ),
}


@dataclass
class FakeCifar:
    """A fake CIFAR dataset written in the official layout, and the arrays it holds."""

    path: Path  # the archive, or the extracted top folder
    pixels: dict[str, np.ndarray]  # split -> (N, 32, 32, 3) uint8
    labels: dict[str, dict[str, np.ndarray]]  # label key -> split -> (N,) int64
    names: dict[str, list[str]]  # name key -> class names


def _official_pickle(obj: object, legacy_numpy_name: bool) -> bytes:
    # Protocol 3 keeps bytes native (protocol 2 would need `_codecs.encode`, which the official
    # Python-2 files do not use). The legacy spelling is what numpy 1.x wrote into the real files.
    data = pickle.dumps(obj, protocol=3)
    if legacy_numpy_name:
        data = data.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
    return data


def build_fake_cifar(
    dest: Path,
    kind: str = "cifar100",
    n_train: int = 20,
    n_test: int = 10,
    *,
    extracted: bool = False,
    compression: str = "gz",
    legacy_numpy_name: bool = True,
    extra_members: dict[str, bytes] | None = None,
) -> FakeCifar:
    """Write a fake CIFAR archive (or extracted folder) into `dest`; see `FakeCifar`."""
    folder, splits, meta_name, label_keys, name_keys = _FAKE_LAYOUTS[kind]
    rng = np.random.default_rng(0)
    counts = {"train": n_train, "test": n_test}
    pixels = {s: rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8) for s, n in counts.items()}
    labels = {
        key: {s: rng.integers(0, k, n).astype(np.int64) for s, n in counts.items()}
        for key, k in label_keys.items()
    }
    names = {key: [f"{key}_{i}" for i in range(k)] for key, k in name_keys.items()}
    files: dict[str, bytes] = {meta_name: _official_pickle(names, legacy_numpy_name)}
    for split, batch_files in splits.items():
        chunks = np.array_split(np.arange(counts[split]), len(batch_files))
        for name, rows in zip(batch_files, chunks, strict=True):
            batch = {
                "batch_label": f"fake {name}",
                "data": pixels[split][rows].transpose(0, 3, 1, 2).reshape(len(rows), 3072),
                "filenames": [f"img_{i}.png" for i in rows],
                **{key: labels[key][split][rows].tolist() for key in label_keys},
            }
            files[name] = _official_pickle(batch, legacy_numpy_name)
    members = {f"{folder}/{name}": data for name, data in files.items()}
    members.update(extra_members or {})
    dest.mkdir(parents=True, exist_ok=True)
    if extracted:
        for member, data in members.items():
            (dest / member).parent.mkdir(parents=True, exist_ok=True)
            (dest / member).write_bytes(data)
        return FakeCifar(dest / folder, pixels, labels, names)
    suffix = f".tar.{compression}" if compression else ".tar"
    path = dest / f"{folder}{suffix}"
    with tarfile.open(path, f"w:{compression}") as tar:
        for member, data in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return FakeCifar(path, pixels, labels, names)


@pytest.fixture
def fake_cifar() -> Callable[..., FakeCifar]:
    """`build_fake_cifar` as a fixture (conftest helpers are not importable under importlib)."""
    return build_fake_cifar


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(base URL, served folder): a local HTTP server on a port chosen by the OS."""
    served = tmp_path / "served"
    served.mkdir()
    handler = partial(_QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="session")
def real_data() -> Path:
    """The real data folder, or skip."""
    root = data_dir()
    if not root.is_dir():
        pytest.skip(f"real data folder {root} is absent (set FASTDATA_DATA_DIR)")
    return root
