"""Shard one dataset on many machines: part I of N writes a slice of the plan; merge finishes.

    fastdata shard folder /data/photos /shared/shards --part 0/3    # on any machine, any order
    fastdata shard folder /data/photos /shared/shards --part 1/3
    fastdata shard folder /data/photos /shared/shards --part 2/3
    fastdata merge /shared/shards                                   # writes manifest.json

Every part computes the writer's whole job plan (`plan.plan_jobs`, a pure function of the
source and the options) and writes the jobs `j` with `j % N == I`, with the writer's atomic
commits and `done` records in `OUT/.fastdata-work/`. So the shards and index files are the ones
a single run writes, byte for byte, whatever order or machine the parts run on, and a part that
is run again resumes where it stopped. A part records itself in
`OUT/.fastdata-work/part-I-of-N.json` ("started", then "finished": identity, classes, the
plan's shard names, host, times, the command that runs it). Parts never write `manifest.json`:
`merge_parts` checks that every part finished with the same source and options, then builds
the manifest from the done records exactly as a single run does.

Parts may write into one shared folder, or each into its own folder that is copied into one
before the merge (the records travel with the shards). The input must be seen at the same path
everywhere: the source's fingerprint, part of the identity, includes its resolved path.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdata.format.manifest import MANIFEST_NAME, Manifest
from fastdata.format.manifest_io import load_manifest
from fastdata.write.carve import carve_source
from fastdata.write.errors import TooManyBadSamplesError, allowance, too_many_message
from fastdata.write.lock import LOCK_NAME, lock_folder
from fastdata.write.plan import plan_jobs
from fastdata.write.results import (
    ShardResult,
    build_manifest,
    is_done,
    load_result,
    lost_results,
    report_skipped,
)
from fastdata.write.sources.base import Source, source_skipped
from fastdata.write.writer import (
    WORK_DIR,
    ShardingError,
    ShardOptions,
    atomic_write,
    dataset_identity,
    run_plan,
    same_identity,
)

__all__ = ["MergeError", "Part", "PartReport", "merge_parts", "write_part"]

log = logging.getLogger("fastdata")
_SHOWN = 5  # shard names listed in a message before "(+k more)"


class MergeError(ShardingError):
    """The parts cannot be merged yet (one is missing or unfinished) or at all (they differ)."""


@dataclass(frozen=True)
class Part:
    """Part `index` of `count` (0 <= index < count): the plan's jobs j with j % count == index."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"part must be I/N with 0 <= I < N, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> Part:
        """'I/N' (e.g. '2/8', as in `--part $SLURM_ARRAY_TASK_ID/8`) -> Part."""
        index, sep, count = text.partition("/")
        try:
            if not sep:
                raise ValueError
            return cls(int(index), int(count))
        except ValueError as exc:
            raise ValueError(f"part must be I/N with 0 <= I < N (e.g. 0/4), got {text!r}") from exc

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def record_name(self) -> str:
        """File name of this part's record in the work folder."""
        return f"part-{self.index:04d}-of-{self.count:04d}.json"


@dataclass(frozen=True)
class PartReport:
    """What one part run did: its shard names, and how many were already done before it ran."""

    part: Part
    shards: list[str]
    already_done: int
    merged: bool = False  # the folder had already been merged: nothing was written


def write_part(
    source: Source,
    out: str | os.PathLike[str],
    options: ShardOptions,
    part: Part,
    command: str | None = None,
) -> PartReport:
    """Write part `part` of the sharding of `source` into `out` (no manifest: see `merge_parts`).

    Args:
        source: the dataset, the same (same fingerprint) for every part.
        out: the output folder, shared by the parts or merged later.
        options: the same for every part (`overwrite` is refused: clear OUT once beforehand).
        part: which part.
        command: the command line that runs a part, with "{part}" where I/N goes; merge shows
            it for a missing part.

    Raises:
        ShardingError: `out` holds another dataset or parts of a sharding with other options.
    """
    if options.overwrite:
        raise ShardingError(
            "--overwrite cannot be used with --part: parts run at the same time would remove "
            "each other's shards; empty the output folder once before starting the parts"
        )
    source = carve_source(source, options.val_fraction, options.seed)
    out_dir = Path(out)
    identity = dataset_identity(source, options)
    # Parts share the folder's lock: they run together by design, but not beside a whole run
    # or a merge.
    with lock_folder(out_dir, shared=True, timeout=options.lock_timeout):
        return _write_part(source, out_dir, options, part, command, identity)


def _write_part(
    source: Source,
    out_dir: Path,
    options: ShardOptions,
    part: Part,
    command: str | None,
    identity: dict[str, Any],
) -> PartReport:
    if _prepare_shared_out(out_dir, identity):
        log.info("%s is already merged with these options; nothing to do", out_dir)
        return PartReport(part, [], 0, merged=True)
    jobs = plan_jobs(source, options)
    mine = [job for number, job in enumerate(jobs) if number % part.count == part.index]
    work = out_dir / WORK_DIR
    record = {
        "part": part.index,
        "parts": part.count,
        "identity": identity,
        "classes": list(source.classes),
        "class_ids": getattr(source, "class_ids", None),
        "source_skipped": source_skipped(source),
        "max_bad": options.max_bad,  # `fastdata merge` checks the whole run against it
        "plan": [job.stem for job in jobs],
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": _now(),
        "status": "started",
        "command": command,
    }
    atomic_write(work / part.record_name, json.dumps(record, sort_keys=True))
    for job in mine:  # partial files a killed run of this part left (other parts' are theirs)
        for tmp in [*out_dir.glob(f"{job.stem}.*.tmp-*"), *work.glob(f"{job.stem}.*.tmp-*")]:
            tmp.unlink(missing_ok=True)
    encoding = identity["options"]["encoding"]
    done_before = run_plan(source, mine, out_dir, encoding, options, source_losses=False)
    record.update(status="finished", finished=_now())
    atomic_write(work / part.record_name, json.dumps(record, sort_keys=True))
    return PartReport(part, [job.stem for job in mine], done_before)


def merge_parts(out: str | os.PathLike[str]) -> Manifest:
    """Check that every part of the sharding in `out` finished alike, then write the manifest.

    The manifest is the one a single run writes (same shard list, counts, checksums, skipped
    samples); the work folder is removed after it is written. Merging a merged folder returns
    its manifest.

    Raises:
        MergeError: no part has run; parts were run with different sources, options or N; a part
            is missing or did not finish (named, with its shards and the command to run).
    """
    out_dir = Path(out)
    with lock_folder(out_dir):
        return _merge(out_dir)


def _merge(out_dir: Path) -> Manifest:
    work = out_dir / WORK_DIR
    if (out_dir / MANIFEST_NAME).exists() and not work.exists():
        return load_manifest(out_dir)
    records = _load_records(work)
    first = records[min(records)]
    count, plan = first["parts"], first["plan"]
    _check_alike(records, first)
    problems = [_part_problem(out_dir, records, Part(i, count), plan) for i in range(count)]
    problems = [p for p in problems if p]
    if problems:
        raise MergeError(
            f"cannot merge {out_dir}: "
            + "; ".join(problems)
            + ". When every part has finished, run `fastdata merge` again."
        )
    results = [load_result(work, stem) for stem in plan]
    # What the source found unusable while opening (a folder's broken links...).
    results += lost_results(first.get("source_skipped", {}))
    _check_bad_overall(results, records)
    report_skipped(results)
    manifest = build_manifest(
        out_dir, first["classes"], first["identity"], results, first.get("class_ids"), work=work
    )
    manifest.save(out_dir)
    shutil.rmtree(work, ignore_errors=True)
    return manifest


# ----------------------------------------------------------------------------- checks


def _check_bad_overall(results: list[ShardResult], records: dict[int, dict[str, Any]]) -> None:
    """TooManyBadSamplesError when the whole run's bad inputs pass `max_bad` (each part checked
    only its own share, without the source's losses, which every part sees)."""
    bad = [list(s) for r in results for s in r.skipped]
    total = sum(r.num_samples for r in results) + len(bad)
    max_bad = min(float(r.get("max_bad", 0.1)) for r in records.values())
    if len(bad) > allowance(max_bad, total):
        raise TooManyBadSamplesError(too_many_message(len(bad), total, max_bad, bad))


def _prepare_shared_out(out_dir: Path, identity: dict[str, Any]) -> bool:
    """Make `out_dir` ready for a part (True: already merged). Safe while other parts start."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / MANIFEST_NAME).exists():
        manifest = load_manifest(out_dir)
        if same_identity(manifest.source, identity):
            return True
        raise ShardingError(
            f"{out_dir} already holds a different dataset ({_differences(manifest.source, identity, ('its manifest', 'this run'))}); "
            "choose another output folder, or remove it before running the parts"
        )
    work = out_dir / WORK_DIR
    plan_file = work / "plan.json"
    if not plan_file.exists():
        others = [p.name for p in out_dir.iterdir() if p.name not in (WORK_DIR, LOCK_NAME)]
        # Another part may have written its plan between our two looks: only then is it ours.
        if others and not plan_file.exists():
            raise ShardingError(
                f"{out_dir} is not empty ({', '.join(sorted(others)[:5])}...) and holds no "
                "unfinished sharding; start the parts in an empty folder"
            )
    work.mkdir(exist_ok=True)
    if plan_file.exists():
        recorded = json.loads(plan_file.read_text())
        if not same_identity(recorded, identity):
            raise ShardingError(
                f"{out_dir} holds parts of a sharding with another source or options "
                f"({_differences(recorded, identity, ('in the folder', 'this run'))}); run every part with the same input and "
                "options, or use another output folder"
            )
    else:
        atomic_write(plan_file, json.dumps(identity, sort_keys=True))  # same bytes from any part
    return False


def _load_records(work: Path) -> dict[int, dict[str, Any]]:
    records = {}
    for path in sorted(work.glob("part-*-of-*.json")) if work.is_dir() else []:
        record = json.loads(path.read_text())
        records[int(record["part"])] = record
    if not records and (work / "plan.json").exists():
        raise MergeError(
            f"{work.parent} holds an unfinished sharding that was not run in parts; run the same "
            "`fastdata shard` command (without --part) again to finish it"
        )
    if not records:
        raise MergeError(
            f"no part has run in {work.parent} (no part records in {work}); run "
            f"`fastdata shard KIND INPUT {work.parent} --part I/N` for I = 0 .. N-1 first"
        )
    return records


def _check_alike(records: dict[int, dict[str, Any]], first: dict[str, Any]) -> None:
    """Every record has the first one's N, identity and plan (else MergeError naming the part)."""
    first_part = Part(first["part"], first["parts"])
    for record in records.values():
        part = Part(record["part"], record["parts"])
        if record["parts"] != first["parts"]:
            raise MergeError(
                f"parts were run with different N: part {part} and part {first_part}; run every "
                "part with the same N (remove the work folder's part-*.json of the wrong N)"
            )
        if (
            not same_identity(record["identity"], first["identity"])
            or record["plan"] != first["plan"]
        ):
            raise MergeError(
                f"part {part} was run with another source or options than part {first_part} "
                f"({_differences(record['identity'], first['identity'], (f'part {part}', f'part {first_part}'))}); run it again with "
                "the same input and options"
            )


def _part_problem(
    out_dir: Path, records: dict[int, dict[str, Any]], part: Part, plan: list[str]
) -> str | None:
    """Why `part` is not ready to merge, with what to run; None when it is."""
    stems = [stem for number, stem in enumerate(plan) if number % part.count == part.index]
    missing = [s for s in stems if not is_done(out_dir, out_dir / WORK_DIR, s)]
    if not missing:
        return None  # every shard of the part is in place, whoever wrote it
    record = records.get(part.index)
    command = next((r["command"] for r in records.values() if r.get("command")), None)
    run = (
        f"run `{command.format(part=part)}`"
        if command
        else f"run part {part} again with the same input and options"
    )
    shown = ", ".join(missing[:_SHOWN]) + (
        f" (+{len(missing) - _SHOWN} more)" if len(missing) > _SHOWN else ""
    )
    lacking = f"shards {shown} are missing"
    if record is None:
        return f"part {part} has not run ({lacking}): {run}"
    if record["status"] != "finished":
        return (
            f"part {part} did not finish (started on {record['host']} at {record['started']}; "
            f"{len(stems) - len(missing)} of {len(stems)} shards written; {lacking}): {run} "
            "(it resumes where it stopped)"
        )
    return f"part {part} finished but {lacking} (lost in a copy?): {run}"


def _differences(recorded: dict[str, Any], identity: dict[str, Any], names: tuple[str, str]) -> str:
    """'options.seed: 0 (part 0/3) vs 1 (part 2/3)' for each field in which identities differ."""
    left, right = names
    diffs = []
    for key in ("kind", "fingerprint", "options", "format_version"):
        a, b = recorded.get(key), identity.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [
                f"{key}.{k}: {a.get(k)!r} ({left}) vs {b.get(k)!r} ({right})"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
        elif a != b:
            diffs.append(f"{key}: {a!r} ({left}) vs {b!r} ({right})")
    return "; ".join(diffs) or "no difference found"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
