"""`fastdata shard ... --engine ray` on a local 2-CPU Ray cluster: the same bytes as one machine,
a worker killed mid-write retried, a killed driver resumed, sizing from Ray's cores.

One cluster for the module (started once, ~20 s on a busy 2-core machine; always shut down).
Test hooks (`writer._test_hooks`) reach the Ray workers through FASTDATA_TEST_HOOKS, set before
the cluster starts: the workers inherit it.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fastdata.cli import main
from fastdata.write import ShardOptions, write_shards
from fastdata.write.engines import EngineUnavailableError, open_engine
from tests.conftest import unique_label_source, write_jpeg_folder

ray = pytest.importorskip("ray")

from fastdata.write.engines.ray import RayEngine  # noqa: E402  (after the skip)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hooks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The test-hook folder, and a local Ray cluster of 2 CPUs whose workers see it."""
    folder = tmp_path_factory.mktemp("hooks")
    previous = os.environ.get("FASTDATA_TEST_HOOKS")
    os.environ["FASTDATA_TEST_HOOKS"] = str(folder)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 << 20,
        log_to_driver=False,
    )
    try:
        yield folder
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("FASTDATA_TEST_HOOKS", None)
        else:
            os.environ["FASTDATA_TEST_HOOKS"] = previous


def digests(folder: Path) -> dict[str, str]:
    """Every file of a shard folder (shards, indexes, sums, manifest...) -> sha256."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != ".fastdata.lock"
    }


def fake_cifar100(dest: Path, n_train: int = 120, n_test: int = 40) -> Path:
    """A CIFAR-100 python archive in the official layout (random pixels, 5 fine classes)."""
    rng = np.random.default_rng(0)

    def dump(obj: object) -> bytes:
        return pickle.dumps(obj, protocol=3)

    members = {
        "meta": dump(
            {"fine_label_names": [f"f{i}" for i in range(5)], "coarse_label_names": ["a", "b"]}
        )
    }
    for split, n in (("train", n_train), ("test", n_test)):
        members[split] = dump(
            {
                "batch_label": split,
                "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                "filenames": [f"img_{i}.png" for i in range(n)],
                "fine_labels": rng.integers(0, 5, n).tolist(),
                "coarse_labels": rng.integers(0, 2, n).tolist(),
            }
        )
    path = dest / "cifar-100-python.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"cifar-100-python/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def shard_cli(*words: str) -> None:
    assert main(["shard", *words, "--no-progress"]) == 0


@pytest.mark.parametrize("kind", ["cifar100", "folder"])
def test_engine_writes_the_bytes_of_one_machine(hooks, tmp_path, kind):
    """~4 s. The CLI with and without --engine ray: every file's sha256 and the manifest."""
    if kind == "cifar100":
        source = fake_cifar100(tmp_path)
    else:
        source = write_jpeg_folder(tmp_path / "images", classes=3, per_class=5)
    common = [kind, str(source)]
    shard_cli(*common, str(tmp_path / "local"), "--max-count", "16")
    shard_cli(*common, str(tmp_path / "ray"), "--max-count", "16", "--engine", "ray")
    local, engine = digests(tmp_path / "local"), digests(tmp_path / "ray")
    assert len(local) > 4 and "manifest.json" in local
    assert engine == local
    assert not (tmp_path / "ray" / ".fastdata-work").exists()


def _other_source(kind: str, root: Path) -> list[str]:
    """The inputs of a small dataset of `kind` written under `root`."""
    from tests.write.sources.family_data import write_coco, write_segmentation

    if kind == "coco":
        return [str(p) for p in write_coco(root)]
    if kind == "segmentation":
        return [str(p) for p in write_segmentation(root, count=5)]
    if kind == "video":
        from tests.video.clips import Clip, make_tree

        clips = [(f"v{i}.mp4", Clip(frames=12, direction=1 - 2 * (i % 2))) for i in range(3)]
        webm = [(f"w{i}.webm", Clip(codec="libvpx-vp9", frames=10)) for i in range(2)]
        return [str(make_tree(root / "videos", {"a": clips, "b": webm}))]
    images = write_jpeg_folder(root / "images", classes=2, per_class=4)
    files = sorted(p.relative_to(root) for p in images.rglob("*.*"))
    if kind == "list":
        lines = [f"{path},{path.parent.name},caption {i}" for i, path in enumerate(files)]
        (root / "list.csv").write_text("path,label,caption\n" + "\n".join(lines) + "\n")
        return [str(root / "list.csv")]
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = {"image": [(root / p).read_bytes() for p in files], "label": [0, 1] * 4}
    pq.write_table(pa.table(table), root / "part.parquet")
    return [str(root / "part.parquet")]


@pytest.mark.parametrize("kind", ["list", "coco", "segmentation", "parquet", "video"])
def test_every_other_source_goes_through_the_engine(hooks, tmp_path, kind):
    """~3 s each. No source-specific code: the same bytes with and without the engine."""
    inputs = _other_source(kind, tmp_path / "data")
    shard_cli(kind, *inputs, str(tmp_path / "local"), "--max-count", "2")
    shard_cli(kind, *inputs, str(tmp_path / "ray"), "--max-count", "2", "--engine", "ray")
    local = digests(tmp_path / "local")
    assert sum(name.endswith(".tar") for name in local) >= 2
    assert digests(tmp_path / "ray") == local


@pytest.mark.realdata
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cifar100", "folder"])
def test_engine_on_the_real_data(hooks, real_data, tmp_path, kind):
    """Real CIFAR-100 archive and clothing-small (~2 min on 2 cores): the same bytes."""
    source = real_data / ("cifar-100-python.tar.gz" if kind == "cifar100" else "clothing-small")
    shard_cli(kind, str(source), str(tmp_path / "local"))
    shard_cli(kind, str(source), str(tmp_path / "ray"), "--engine", "ray")
    assert digests(tmp_path / "ray") == digests(tmp_path / "local")


def test_a_worker_killed_mid_write_is_retried(hooks, tmp_path):
    """~8 s. The first shard's worker SIGKILLs itself after one sample; Ray runs the task
    again; the output is the one-machine output and no partial file is left."""
    options = ShardOptions(max_count=64, progress=False)
    write_shards(unique_label_source(), tmp_path / "local", options)
    (hooks / "killed").unlink(missing_ok=True)
    (hooks / "kill-once").touch()
    try:
        write_shards(unique_label_source(), tmp_path / "ray", options, engine=RayEngine())
    finally:
        (hooks / "kill-once").unlink()
    pid, stem = (hooks / "killed").read_text().split()
    assert int(pid) != os.getpid()  # a worker died, not this driver
    assert digests(tmp_path / "ray") == digests(tmp_path / "local")
    assert not list((tmp_path / "ray").glob("*.tmp-*"))


def test_a_rerun_after_a_killed_driver_writes_only_the_missing_shards(hooks, tmp_path):
    """~30 s. A driver (the CLI, joined to this cluster) SIGKILLed after a few shards: the
    re-run writes exactly the shards that had no done record, and the result is whole."""
    images = write_jpeg_folder(tmp_path / "images", classes=3, per_class=4)
    out = tmp_path / "ray"
    words = ["folder", str(images), str(out), "--max-count", "1", "--no-progress"]
    shard_cli("folder", str(images), str(tmp_path / "local"), "--max-count", "1")
    (hooks / "delay").write_text("0.5")
    log = hooks / "written.log"
    log.unlink(missing_ok=True)
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "fastdata", "shard", *words, "--engine", "ray"]
    driver = subprocess.Popen([*command, "--address", address], env=env)
    try:
        done = _wait_for(lambda: len(_done(out)) >= 3 or driver.poll() is not None, 120)
        assert done and driver.poll() is None, "the driver finished before it could be killed"
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        # Tasks of the dead driver are cancelled by Ray; wait until no more shards appear.
        _wait_for(lambda: _stable(out), 60)
    finally:
        (hooks / "delay").unlink()
        if driver.poll() is None:
            driver.kill()
    before = _done(out)
    assert 3 <= len(before) < 12
    log.unlink(missing_ok=True)
    shard_cli(*words[:-1], "--engine", "ray", "--tasks", "3")
    rewritten = log.read_text().split()
    assert sorted(rewritten) == sorted(f"train-{n:06d}" for n in range(12) if n not in before)
    assert digests(out) == digests(tmp_path / "local")


def _done(out: Path) -> set[int]:
    work = out / ".fastdata-work"
    return {int(p.name.split("-")[1].split(".")[0]) for p in work.glob("train-*.done.json")}


def _stable(out: Path, quiet_s: float = 3.0) -> bool:
    first = _done(out)
    time.sleep(quiet_s)
    return _done(out) == first


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def test_tasks_are_sized_from_the_cores_ray_reports(hooks):
    """The cluster has 2 CPUs whatever this machine has: four tasks a CPU, one per job at most."""
    engine = RayEngine()
    assert engine.cpus() == 2
    assert engine.tasks_for(100) == 8
    assert engine.tasks_for(3) == 3
    assert RayEngine(tasks=5).tasks_for(100) == 5
    engine.close()
    assert ray.is_initialized()  # joined in-process: not ours to shut down


def test_a_local_cluster_is_started_on_the_usable_cores_and_shut_down(monkeypatch):
    """Without --address the engine starts Ray on the usable cores, no dashboard, and stops it."""
    calls: list[tuple[str, dict]] = []

    class FakeRay:
        @staticmethod
        def is_initialized() -> bool:
            return False

        @staticmethod
        def init(**kwargs) -> None:
            calls.append(("init", kwargs))

        @staticmethod
        def shutdown() -> None:
            calls.append(("shutdown", {}))

    monkeypatch.setitem(sys.modules, "ray", FakeRay)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    engine = RayEngine()
    engine.start()
    engine.close()
    assert calls == [("init", {"num_cpus": 3, "include_dashboard": False}), ("shutdown", {})]


def test_without_ray_the_option_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(EngineUnavailableError, match=r'pip install "fastdata\[ray\]"'):
        open_engine("ray")
    images = write_jpeg_folder(tmp_path / "images")
    with pytest.raises(SystemExit, match=r'--engine ray: .*pip install "fastdata\[ray\]"'):
        main(["shard", "folder", str(images), str(tmp_path / "out"), "--engine", "ray"])
    assert not (tmp_path / "out").exists()  # refused before anything is written


GUIDE = ROOT / "docs" / "guides" / "cluster.md"


def test_the_cluster_guide_runs(hooks, tmp_path, monkeypatch, capsys):
    """~20 s. Every ```bash and ```python block of docs/guides/cluster.md, as written, in a
    folder holding `images/`; the commands join this module's cluster through $RAY_ADDRESS."""
    import re

    blocks = re.findall(r"```(bash|python)\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert [kind for kind, _ in blocks] == ["bash", "python", "bash"]
    write_jpeg_folder(tmp_path / "images", classes=3, per_class=4)
    monkeypatch.chdir(tmp_path)
    env = {
        **os.environ,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    for kind, code in blocks:
        if kind == "bash":
            subprocess.run(["bash", "-e", "-c", code], env=env, check=True, timeout=300)
        else:
            exec(compile(code, str(GUIDE), "exec"), {})
    assert capsys.readouterr().out.strip() == "12"
    for folder in ("out", "out-py", "parts"):
        assert digests(tmp_path / folder)["manifest.json"]
    assert digests(tmp_path / "out") == digests(tmp_path / "parts")
