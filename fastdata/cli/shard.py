"""`fastdata shard` and `fastdata merge`: the flags, read into `ShardOptions` (whose defaults
they take) and the source's keyword options (those the registry's `SourceKind.options` names for
it), then `write_shards` or `write_part`."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from typing import Any

from fastdata._util.sizes import parse_size

__all__ = ["add_shard", "read_classes"]


_LIST_COLUMNS = """\
list files (CSV with a header, or JSON Lines): `path` (required), `split` (optional), and
  label    one class (index or name)              -> a `label` field (cls)
  labels   several classes: a JSON list, or "a;b" -> a `labels` field (multi-label)
  caption / text                                 -> a text field (txt)
  any other column: CSV text -> a text field `<name>.txt`; JSONL values -> a json field
  `<name>.json` (strings stay text). Only path + label (+ split): classification, (x, y)."""


def add_shard(sub: argparse._SubParsersAction) -> None:
    from fastdata.write.sources import REGISTRY

    kinds = "\n".join(
        f"  {k.name:<13} {' '.join(k.inputs)} OUT: {k.help}" for k in REGISTRY.values()
    )
    p = sub.add_parser(
        "shard",
        help="convert a dataset into tar shards + manifest + DALI index",
        description="Convert a dataset into tar shards + manifest + DALI index.",
        epilog=f"sources:\n{kinds}\n\n{_LIST_COLUMNS}\n\n{_SIZES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", choices=list(REGISTRY), help="the kind of dataset (see below)")
    p.add_argument(
        "paths",
        nargs="+",
        metavar="INPUT... OUT",
        help="the source's inputs (archive, folder or list file; IMAGES ANNOTATIONS for coco; "
        "IMAGES MASKS for segmentation; none for cifar with --download), then the output folder "
        "or s3://bucket/prefix (uploaded, manifest last)",
    )
    _add_shard_options(p)
    for name, (keywords, _) in _SOURCE_FLAGS.items():  # help: the sources that take it first
        takers = ", ".join(k.name for k in REGISTRY.values() if name in k.options)
        default = _source_default(REGISTRY, name)
        keywords = {**keywords, "help": f"{takers}: {keywords['help']}".format(default=default)}
        p.add_argument("--" + name.replace("_", "-"), default=None, **keywords)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--part",
        default=None,
        metavar="I/N",
        help="write only part I of N (0 <= I < N; e.g. $SLURM_ARRAY_TASK_ID/8), no manifest: "
        "run every part, then `fastdata merge OUT`",
    )
    _add_shard_engine(p)
    p.set_defaults(func=_shard)
    merge = sub.add_parser("merge", help="check that every --part finished, write the manifest")
    merge.add_argument("out", help="output folder the parts wrote into")
    merge.set_defaults(func=_merge)


_SIZES = "sizes: 500MB or 500M = 500*10**6 bytes; 512MiB or 512Mi = 512*2**20 (K, M, G, T)"


def _add_shard_options(p: argparse.ArgumentParser) -> None:
    """The flags of `ShardOptions`' fields, with its defaults (read from the dataclass)."""
    from fastdata.write import ENCODINGS, ShardOptions

    d = ShardOptions()
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the cross-shard shuffle")
    p.add_argument("--max-count", type=int, default=d.max_count, help="most samples per shard")
    p.add_argument(
        "--max-size", type=_size, default=d.max_size, help="most bytes per shard, e.g. 256MB"
    )
    p.add_argument(
        "--workers", type=int, default=d.workers, help="writer processes (default: usable cores)"
    )
    p.add_argument("--encoding", default=d.encoding, choices=list(ENCODINGS))
    p.add_argument(
        "--resize", type=int, default=d.resize, help="shrink the shorter side to this many pixels"
    )
    p.add_argument("--quality", type=int, default=d.quality, help="JPEG quality when re-encoding")
    p.add_argument(
        "--strict", action="store_true", help="stop at the first bad image instead of skipping it"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a different dataset in OUT")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        metavar="F",
        help="carve this share of the training split into a 'val' split (seeded by --seed), "
        "for sources without one (cifar10/100, a folder without val/, a list file)",
    )
    p.add_argument(
        "--max-side",
        type=int,
        default=d.max_side,
        metavar="N",
        help="store images no larger than N pixels on their longer side (resized, JPEG "
        "re-encoded at --quality only when shrunk; masks and boxes move with them)",
    )
    _add_shard_limits(p, d)


def _add_shard_limits(p: argparse.ArgumentParser, d: Any) -> None:
    """Bounds on untrusted input (`ShardOptions` `d`'s defaults)."""
    p.add_argument(
        "--max-bad",
        type=float,
        default=d.max_bad,
        metavar="F",
        help="stop (exit 1, no manifest) when more than this fraction of the inputs is bad "
        f"(default {d.max_bad}; 1 never stops)",
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        default=d.max_pixels,
        help="skip images with more pixels than this, read from the header before decoding "
        f"(default {d.max_pixels:,})",
    )
    p.add_argument(
        "--lock-timeout",
        type=float,
        default=d.lock_timeout,
        metavar="S",
        help="wait up to S seconds for another run writing into OUT (default "
        f"{d.lock_timeout:g}: refuse at once)",
    )


def _size(text: str) -> int:
    """A size flag's bytes (`fastdata._util.sizes.parse_size`: "500MB", "2G", "512MiB")."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def read_classes(path: str) -> list[str]:
    """A `--classes` file's names, one a line (`shard` and `index`: line i names class i, so
    only blank lines at the end are ignored)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(16 << 20)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--classes {path}: cannot read ({exc})") from exc
    names = [line.strip() for line in text.rstrip("\n").split("\n")]
    if not names or not all(names):
        raise ValueError(f"--classes {path}: needs one non-empty name a line")
    return names


#: Flags that set the source's keyword option of the same name: the registry's
#: `SourceKind.options` says which sources take each. Each: (argparse keywords, the option's
#: value from the flag's). Not given (None): the source's own default.
_SOURCE_FLAGS: dict[str, tuple[dict[str, Any], Callable[[Any], Any]]] = {
    "download": (
        {"action": "store_true", "help": "download the official archive (MD5-checked)"},
        bool,
    ),
    "classes": (
        {"metavar": "FILE", "help": "class names, one a line (index i = line i)"},
        read_classes,
    ),
    "split": (
        {
            "help": "the split's name (coco); that of files their path names no split for "
            "(parquet); default train"
        },
        str,
    ),
    "max_json_bytes": (
        {
            "type": _size,
            "metavar": "SIZE",
            "help": "largest annotations json read, e.g. 4GB "
            "(default {default:,} bytes; raise it for a trusted file)",
        },
        int,
    ),
    "ignore_index": (
        {
            "type": int,
            "help": "the mask value of pixels with no class (default {default}; -1: none)",
        },
        lambda value: None if value < 0 else value,
    ),
    "max_classes": (
        {"type": int, "help": "most classes the labels may imply (default {default:,})"},
        int,
    ),
    "max_video_bytes": (
        {
            "type": _size,
            "metavar": "SIZE",
            "help": "largest video file accepted, e.g. 8GB (default {default:,} bytes)",
        },
        int,
    ),
}


def _source_default(registry: dict[str, Any], name: str) -> Any:
    """The default of keyword option `name` of the first source that takes it."""
    import inspect

    kind = next(k for k in registry.values() if name in k.options)
    return inspect.signature(kind.factory).parameters[name].default


def _shard(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from fastdata.format.manifest import MANIFEST_NAME
    from fastdata.format.summary import summarize
    from fastdata.write import ShardOptions, TooManyBadSamplesError, write_shards
    from fastdata.write.sources import open_source

    options = ShardOptions(
        **{f.name: getattr(args, f.name) for f in fields(ShardOptions) if f.name != "progress"},
        progress=not args.no_progress,
    )
    kwargs = _source_options(args)
    source = open_source(args.source, *_split_paths(args), **kwargs)
    engine = _engine(args)
    try:
        if args.part is not None:
            return _shard_part(args, source, options)
        manifest = write_shards(source, args.out, options, engine=engine)
    except TooManyBadSamplesError as exc:  # the input, not the tool, failed: exit 1
        print(f"fastdata shard: {exc}", file=sys.stderr)
        return 1
    finally:
        if engine is not None:
            engine.close()
    print(summarize(manifest))
    print(f"wrote {args.out}/{MANIFEST_NAME}")
    return 0


def _source_options(args: argparse.Namespace) -> dict[str, Any]:
    """The source's keyword options from the `_SOURCE_FLAGS` given (one given to a source that
    does not take it is refused, naming those that do)."""
    from fastdata.write.sources import REGISTRY

    kwargs: dict[str, Any] = {}
    for name, (_, value_of) in _SOURCE_FLAGS.items():
        value = getattr(args, name)
        if value is None or value is False:
            continue
        if name not in REGISTRY[args.source].options:
            takers = [k.name for k in REGISTRY.values() if name in k.options]
            plural = "s" if len(takers) > 1 else ""
            raise ValueError(
                f"--{name.replace('_', '-')} is for the {', '.join(takers)} source{plural}, "
                f"not {args.source}"
            )
        kwargs[name] = value_of(value)
    return kwargs


def _split_paths(args: argparse.Namespace) -> list[str | None]:
    """The source's inputs from `paths` (OUT, the last, goes to `args.out`); checks the count."""
    from fastdata.write.sources import REGISTRY

    wanted = REGISTRY[args.source].inputs
    *inputs, args.out = args.paths
    if args.download and not inputs:
        inputs = [None]
    if len(inputs) != len(wanted):
        raise ValueError(
            f"{args.source}: expected {' '.join(wanted)} OUT, got "
            f"{len(args.paths)} path(s)"
            + (" (or --download OUT)" if args.source.startswith("cifar") else "")
        )
    return inputs


def _shard_part(args: argparse.Namespace, source: Any, options: Any) -> int:
    from fastdata.write.parts import Part, write_part

    part = Part.parse(args.part)
    if "://" in args.out:
        raise ValueError(
            "--part writes into a folder that every part can reach (or that is copied together "
            "before `fastdata merge`), not to a URL"
        )
    report = write_part(source, args.out, options, part, command=_part_command(args))
    if report.merged:
        print(f"{args.out} is already merged; nothing to do")
        return 0
    print(
        f"part {part}: {len(report.shards)} shards in {args.out} "
        f"({report.already_done} already written before this run)"
    )
    print(f"when all {part.count} parts have finished: fastdata merge {shlex.quote(args.out)}")
    return 0


#: Arguments that do not change what a part writes: left out of the command `merge` shows.
_NOT_IN_PART_COMMAND = {"overwrite", "no_progress", "lock_timeout", "engine", "address", "tasks"}


def _part_command(args: argparse.Namespace) -> str:
    """The command line that runs any part of this sharding, with "{part}" for I/N: the flags
    whose value is not the parser's default."""
    words = ["fastdata", "shard", args.source, *args.paths]
    parser = argparse.ArgumentParser()
    add_shard(parser.add_subparsers(dest="command"))
    defaults = parser.parse_args(["shard", args.source, *args.paths])
    skip = _NOT_IN_PART_COMMAND | {"command", "func", "source", "paths", "part", "verbose", "out"}
    for name, value in vars(args).items():
        if name not in skip and value != getattr(defaults, name, value):
            flag = "--" + name.replace("_", "-")
            words += [flag] if value is True else [flag, str(value)]
    # Braces escaped for str.format: only the "{part}" placeholder stays.
    quoted = shlex.join(words).replace("{", "{{").replace("}", "}}")
    return quoted + " --part {part}"


def _add_shard_engine(p: argparse.ArgumentParser) -> None:
    """Where the shards are written (`fastdata.write.engines`)."""
    p.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local: processes on this machine (default); ray: tasks on a Ray cluster "
        '(pip install "fastdata[ray]"), OUT on a file system every node reaches',
    )
    p.add_argument(
        "--address",
        default=None,
        help="ray: the cluster to join (e.g. auto, ray://head:10001); default: $RAY_ADDRESS, "
        "else a local one on the usable cores, shut down at the end",
    )
    p.add_argument(
        "--tasks",
        type=int,
        default=None,
        metavar="N",
        help="ray: cut the plan into N tasks (default: four per CPU the cluster reports)",
    )


def _engine(args: argparse.Namespace) -> Any:
    """The `--engine` (None: local), after checking the options that go with it."""
    if args.engine == "local":
        if args.address is not None or args.tasks is not None:
            raise ValueError("--address and --tasks are for --engine ray")
        return None
    if args.part is not None:
        raise ValueError(
            "--part and --engine ray are two ways to split a run over machines: use one"
        )
    if "://" in args.out and args.address is not None:
        raise ValueError(
            "--engine ray with --address writes into a folder every node reaches, not to a URL: "
            "shard into a shared folder, then `python -m fastdata.write.upload FOLDER URL`"
        )
    from fastdata.write.engines import EngineUnavailableError, open_engine

    try:
        return open_engine(args.engine, address=args.address, tasks=args.tasks)
    except EngineUnavailableError as exc:
        raise SystemExit(f"fastdata shard: --engine ray: {exc}") from None


def _merge(args: argparse.Namespace) -> int:
    from fastdata.format.manifest import MANIFEST_NAME
    from fastdata.format.summary import summarize
    from fastdata.write import TooManyBadSamplesError
    from fastdata.write.parts import merge_parts

    try:
        manifest = merge_parts(args.out)
    except TooManyBadSamplesError as exc:  # the whole run's inputs, counted once: exit 1
        print(f"fastdata merge: {exc}", file=sys.stderr)
        return 1
    print(summarize(manifest))
    print(f"wrote {args.out}/{MANIFEST_NAME}")
    return 0
