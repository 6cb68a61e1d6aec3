"""Reading a whole split through a ShardReader in plan order (also the target of rank processes)."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
import traceback

from fastdata.format.manifest import Manifest
from fastdata.read.plan import epoch_order, rows_to_refs
from fastdata.read.shardio import ShardReader
from fastdata.remote import ShardCache
from fastdata.remote.cache import folder_bytes

__all__ = ["folder_bytes", "plan_shard_order", "rank_main", "read_epoch"]


def plan_shard_order(manifest: Manifest, split: str, seed: int = 0, epoch: int = 0) -> list[int]:
    """Shard numbers in the order the training plan (read.plan rule 1) first reads them."""
    sizes = [s.num_samples for s in manifest.split(split).shards]
    refs = rows_to_refs(epoch_order(sizes, seed, epoch, shuffle=True), sizes)
    return [int(s) for s in dict.fromkeys(refs[:, 0].tolist())]


def read_epoch(
    manifest: Manifest,
    split: str,
    cache: ShardCache | None,
    order: list[int],
    prefetch: int = 0,
    start: multiprocessing.synchronize.Event | None = None,
) -> tuple[dict[str, str], list[int]]:
    """Every sample of every shard in `order`: key -> sha256 of its components, and the cache
    folder's size after each shard is opened."""
    if start is not None:
        start.wait(timeout=60)
    reader = ShardReader(manifest, split, max_open=1, cache=cache)
    if prefetch and cache is not None:
        cache.prefetch(manifest, [reader.shards[n] for n in order], ahead=prefetch)
    seen: dict[str, str] = {}
    sizes: list[int] = []
    try:
        for number in order:
            for index in range(reader.shards[number].num_samples):
                parts = reader.sample(number, index)
                digest = hashlib.sha256()
                for ext in sorted(parts):
                    digest.update(ext.encode() + bytes(parts[ext]))
                key = reader.key(number, index)
                assert key not in seen, f"sample {key} delivered twice"
                seen[key] = digest.hexdigest()
            if cache is not None:
                sizes.append(folder_bytes(cache.cache_dir))
    finally:
        reader.close()
    return seen, sizes


def rank_main(results: multiprocessing.Queue, *args: object) -> None:
    """A "rank" process: `read_epoch(*args)`, its result (or its error) put on `results`."""
    try:
        results.put(read_epoch(*args))  # type: ignore[arg-type]
    except BaseException as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+: the parent's assertion shows where
            exc.add_note(traceback.format_exc())
        results.put(exc)


def holds_write_lock(pid: int) -> bool:
    """Whether process `pid` holds an exclusive flock (per /proc/locks; False where unreadable)."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    return any(
        len(fields) > 4 and fields[1] == "FLOCK" and fields[3] == "WRITE" and fields[4] == str(pid)
        for fields in (line.split() for line in lines)
    )


def loader_rank_main(
    results: multiprocessing.Queue,
    manifest: Manifest,
    cache: ShardCache,
    rank: int,
    world_size: int,
    batch_size: int,
) -> None:
    """A "rank" process reading one training epoch with the cpu backend and 2 DataLoader workers;
    its main process prefetches too (as the loader tuner does), so the workers fork while a
    download is under way. Puts (rank, labels) on `results`, or (rank, "Type: message")."""
    from fastdata.read.backends.cpu import make_cpu_loader
    from fastdata.read.base import LoaderSpec, WorkerSettings

    try:
        workers = WorkerSettings(num_workers=2, prefetch_factor=2, persistent_workers=False)
        spec = LoaderSpec(
            manifest, "train", train=True, batch_size=batch_size, seed=5, rank=rank,
            world_size=world_size, cache=cache, workers=workers,
        )  # fmt: skip
        loader = make_cpu_loader(spec)
        order = plan_shard_order(manifest, "train")
        order = order[rank:] + order[:rank]  # each rank's main process downloads its own first
        ShardReader(manifest, "train", cache=cache).prefetch(order)
        deadline = time.monotonic() + 10  # fork the workers while that download holds its lock
        while not holds_write_lock(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.005)
        labels = [y for _, batch in loader for y in batch.tolist()]
        results.put((rank, labels))
    except BaseException as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))
