"""The `fastdata` command line: a thin layer over library functions.

fastdata shard SOURCE INPUT... OUT [options]  # cifar10 | cifar100 | folder | list | coco | segmentation
fastdata shard SOURCE INPUT OUT --part I/N  # part I of N, on any machine; then:
fastdata merge OUT                          # check the parts, write the manifest
fastdata index DIR_OR_URL [--out OUT]       # other tools' WebDataset tars, read in place
fastdata inspect OUT
fastdata verify OUT
fastdata tune OUT [--sweep]
fastdata train cifar100 [--data ARCHIVE | --download] [options]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from fastdata._util.version import __version__

__all__ = ["build_parser", "main"]

# Subcommands that live with their feature: "module:function" taking the subparsers object.
EXTERNAL_COMMANDS = {
    "index": "fastdata.write.index:register",
    "tune": "fastdata.tune.command:register",
    "train": "fastdata.train.command:register",
}


#: Commands defined in this module: running one imports no feature command (`tune` imports
#: torch, `train` Lightning: seconds of start-up that `fastdata shard` does not need).
BUILTIN_COMMANDS = ("shard", "merge", "inspect", "verify")


def build_parser(features: bool = True) -> argparse.ArgumentParser:
    """The `fastdata` parser; `features=False` leaves out `EXTERNAL_COMMANDS` (not imported)."""
    parser = argparse.ArgumentParser(prog="fastdata", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"fastdata {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_shard(sub)
    inspect = sub.add_parser("inspect", help="print a summary of a shard folder")
    inspect.add_argument("out", help="shard folder (holding manifest.json)")
    inspect.set_defaults(func=_inspect)
    verify = sub.add_parser("verify", help="re-hash every shard and decode every sample")
    verify.add_argument("out", help="shard folder (holding manifest.json)")
    verify.add_argument("--no-progress", action="store_true")
    verify.set_defaults(func=_verify)
    for name, target in EXTERNAL_COMMANDS.items() if features else ():
        module, func = target.split(":")
        try:
            getattr(importlib.import_module(module), func)(sub)
        except ImportError as exc:  # a feature whose optional dependency is missing
            logging.getLogger("fastdata").warning("command %r unavailable: %s", name, exc)
    return parser


_LIST_COLUMNS = """\
list files (CSV with a header, or JSON Lines): `path` (required), `split` (optional), and
  label    one class (index or name)              -> a `label` field (cls)
  labels   several classes: a JSON list, or "a;b" -> a `labels` field (multi-label)
  caption / text                                 -> a text field (txt)
  any other column: CSV text -> a text field `<name>.txt`; JSONL values -> a json field
  `<name>.json` (strings stay text). Only path + label (+ split): classification, (x, y)."""


def _add_shard(sub: argparse._SubParsersAction) -> None:
    from fastdata.write.sources import REGISTRY

    kinds = "\n".join(
        f"  {k.name:<13} {' '.join(k.inputs)} OUT: {k.help}" for k in REGISTRY.values()
    )
    p = sub.add_parser(
        "shard",
        help="convert a dataset into tar shards + manifest + DALI index",
        description="Convert a dataset into tar shards + manifest + DALI index.",
        epilog=f"sources:\n{kinds}\n\n{_LIST_COLUMNS}",
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
    p.add_argument(
        "--download", action="store_true", help="cifar: download the official archive (MD5-checked)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the cross-shard shuffle")
    p.add_argument("--max-count", type=int, default=10_000, help="most samples per shard")
    p.add_argument("--max-size", type=_size, default=None, help="most bytes per shard, e.g. 256M")
    p.add_argument(
        "--workers", type=int, default=None, help="writer processes (default: usable cores)"
    )
    p.add_argument("--encoding", default="auto", choices=["auto", "raw", "png", "jpeg", "keep"])
    p.add_argument(
        "--resize", type=int, default=None, help="shrink the shorter side to this many pixels"
    )
    p.add_argument("--quality", type=int, default=90, help="JPEG quality when re-encoding")
    p.add_argument(
        "--strict", action="store_true", help="stop at the first bad image instead of skipping it"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a different dataset in OUT")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        metavar="F",
        help="carve this share of the training split into a 'val' split (seeded by --seed), "
        "for sources without one (cifar10/100, a folder without val/, a list file)",
    )
    p.add_argument(
        "--max-side",
        type=int,
        default=None,
        metavar="N",
        help="store images no larger than N pixels on their longer side (resized, JPEG "
        "re-encoded at --quality only when shrunk; masks and boxes move with them)",
    )
    p.add_argument(
        "--classes",
        default=None,
        metavar="FILE",
        help="list, segmentation, parquet: class names, one a line (index i = line i)",
    )
    p.add_argument(
        "--split",
        default=None,
        help="coco: the split's name; parquet: that of files their path names no split for "
        "(default train)",
    )
    p.add_argument(
        "--max-json-bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="coco: largest annotations json read, e.g. 4G (default 2G; raise it for a trusted "
        "file)",
    )
    p.add_argument(
        "--ignore-index",
        type=int,
        default=255,
        help="segmentation: the mask value of pixels with no class (default 255; -1: none)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--part",
        default=None,
        metavar="I/N",
        help="write only part I of N (0 <= I < N; e.g. $SLURM_ARRAY_TASK_ID/8), no manifest: "
        "run every part, then `fastdata merge OUT`",
    )
    _add_shard_limits(p)
    _add_shard_engine(p)
    p.set_defaults(func=_shard)
    merge = sub.add_parser("merge", help="check that every --part finished, write the manifest")
    merge.add_argument("out", help="output folder the parts wrote into")
    merge.set_defaults(func=_merge)


def _add_shard_limits(p: argparse.ArgumentParser) -> None:
    """Bounds on untrusted input (see `ShardOptions` and `ListSource`)."""
    from fastdata.write.encode import DEFAULT_MAX_PIXELS
    from fastdata.write.sources.listfile import DEFAULT_MAX_CLASSES

    p.add_argument(
        "--max-bad",
        type=float,
        default=0.1,
        metavar="F",
        help="stop (exit 1, no manifest) when more than this fraction of the inputs is bad "
        "(default 0.1; 1 never stops)",
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        default=DEFAULT_MAX_PIXELS,
        help="skip images with more pixels than this, read from the header before decoding "
        f"(default {DEFAULT_MAX_PIXELS:,})",
    )
    p.add_argument(
        "--max-classes",
        type=int,
        default=DEFAULT_MAX_CLASSES,
        help=f"list: most classes the labels may imply (default {DEFAULT_MAX_CLASSES:,})",
    )
    p.add_argument(
        "--lock-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for another run writing into OUT (default 0: refuse at once)",
    )


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


def _size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
    except (ValueError, IndexError) as exc:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 500M or 1G)") from exc


def _shard(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from fastdata.format.manifest import MANIFEST_NAME
    from fastdata.format.summary import summarize
    from fastdata.write import ShardOptions, TooManyBadSamplesError, write_shards
    from fastdata.write.sources import open_source

    if args.download and args.source not in ("cifar10", "cifar100"):
        raise SystemExit(
            f"fastdata shard: --download is only for cifar10/cifar100, not {args.source}"
        )
    inputs = _split_paths(args)
    source = open_source(args.source, *inputs, **_source_options(args))
    options = ShardOptions(
        seed=args.seed,
        max_count=args.max_count,
        max_size=args.max_size,
        workers=args.workers,
        encoding=args.encoding,
        resize=args.resize,
        quality=args.quality,
        strict=args.strict,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        val_fraction=args.val_fraction,
        max_bad=args.max_bad,
        max_pixels=args.max_pixels,
        lock_timeout=args.lock_timeout,
        max_side=args.max_side,
    )
    engine = _engine(args)
    try:
        if args.part is not None:
            return _shard_part(args, source, options)
        if "://" in args.out:  # an object store: write locally, then upload (manifest last)
            from fastdata.write.upload import staged_upload

            with staged_upload(args.out) as local:
                manifest = write_shards(source, local, options, engine=engine)
            manifest = replace(manifest, root=args.out)  # name the uploaded copy, not staging
        else:
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
    args.input = inputs[0]
    return inputs


def _source_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword options of the source class from the shard flags that concern it."""
    kwargs: dict[str, Any] = {"download": True} if args.download else {}
    if args.source == "list":
        kwargs["max_classes"] = args.max_classes
    if args.classes is not None:
        if args.source not in ("list", "segmentation", "parquet"):
            raise ValueError("--classes is for list, segmentation and parquet sources")
        kwargs["classes"] = _read_classes(args.classes)
    if args.split is not None:
        if args.source not in ("coco", "parquet"):
            raise ValueError("--split is for the coco and parquet sources")
        kwargs["split"] = args.split
    if args.max_json_bytes is not None:
        if args.source != "coco":
            raise ValueError("--max-json-bytes is for the coco source")
        kwargs["max_json_bytes"] = args.max_json_bytes
    if args.source == "segmentation":
        kwargs["ignore_index"] = None if args.ignore_index < 0 else args.ignore_index
    return kwargs


def _read_classes(path: str) -> list[str]:
    """Class names, one a line (blank lines at the end ignored)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(16 << 20)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--classes {path}: cannot read ({exc})") from exc
    names = [line.strip() for line in text.rstrip("\n").split("\n")]
    if not names or not all(names):
        raise ValueError(f"--classes {path}: needs one non-empty name a line")
    return names


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


def _part_command(args: argparse.Namespace) -> str:
    """The command line that runs any part of this sharding, with "{part}" for I/N."""
    from fastdata.write.encode import DEFAULT_MAX_PIXELS
    from fastdata.write.sources.listfile import DEFAULT_MAX_CLASSES

    words = ["fastdata", "shard", args.source, *args.paths]
    defaults = {"seed": 0, "max_count": 10_000, "max_size": None, "encoding": "auto"}
    defaults |= {"resize": None, "quality": 90, "workers": None, "val_fraction": None}
    defaults |= {"max_side": None, "classes": None, "split": None, "ignore_index": 255}
    defaults |= {"max_json_bytes": None}
    defaults |= {
        "max_bad": 0.1,
        "max_pixels": DEFAULT_MAX_PIXELS,
        "max_classes": DEFAULT_MAX_CLASSES,
    }
    for name, default in defaults.items():
        if getattr(args, name) != default:
            words += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    words += ["--download"] * args.download + ["--strict"] * args.strict
    # Braces escaped for str.format: only the "{part}" placeholder stays.
    quoted = shlex.join(words).replace("{", "{{").replace("}", "}}")
    return quoted + " --part {part}"


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


def _inspect(args: argparse.Namespace) -> int:
    from fastdata.format.manifest import ManifestError
    from fastdata.format.manifest_io import load_manifest
    from fastdata.format.summary import summarize
    from fastdata.read.verify import inspect_findings

    try:
        manifest = load_manifest(args.out)
    except ManifestError as exc:
        print(f"bad manifest: {exc}")
        return 1
    print(summarize(manifest))
    findings = inspect_findings(manifest)
    for finding in findings:
        print(f"  problem: {finding}")
    if findings:
        print(f"{len(findings)} problem(s); run `fastdata verify {args.out}` for every sample")
    return 1 if findings else 0


def _verify(args: argparse.Namespace) -> int:
    from fastdata.read.verify import verify

    report = verify(args.out, progress=not args.no_progress)
    print(report)
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fastdata` console script and `python -m fastdata`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Before the parser is built: it logs (at debug) a feature command that could not load.
    verbose = "-v" in argv or "--verbose" in argv
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s")
    # The command is the first word that is not an option (the top-level options take no value).
    command = next((word for word in argv if not word.startswith("-")), None)
    args = build_parser(features=command not in BUILTIN_COMMANDS).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError, OSError) as exc:
        # User-facing failures (bad input, a refused output folder...) without a traceback.
        print(f"fastdata {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
