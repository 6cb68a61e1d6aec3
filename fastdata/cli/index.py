"""`fastdata index`: other tools' WebDataset tars, read in place (`fastdata.write.index`)."""

from __future__ import annotations

import argparse

__all__ = ["add_index"]


def add_index(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "index",
        help="index other tools' WebDataset tars in place (manifest + DALI index, tars untouched)",
    )
    p.add_argument(
        "source",
        help="folder of tars (.tar; .tar.gz/.tgz are inflated into OUT), URL pattern "
        "(shards-{000..009}.tar) or URL list",
    )
    p.add_argument(
        "--out", default=None, help="folder for manifest and index files (default: SOURCE)"
    )
    p.add_argument(
        "--split",
        action="append",
        default=[],
        metavar="NAME=PATTERN",
        help="tars matching PATTERN form split NAME (default: by file-name prefix)",
    )
    p.add_argument("--classes", default=None, help="file of class names, one a line")
    p.add_argument(
        "--workers", type=int, default=None, help="tars read at once (default: usable cores)"
    )
    p.set_defaults(func=_index)


def _index(args: argparse.Namespace) -> int:
    from fastdata.cli.shard import read_classes
    from fastdata.format.manifest import MANIFEST_NAME
    from fastdata.write.index import ORDERED_LABELS, IndexOptions, index_shards

    splits = {}
    for item in args.split:
        name, eq, pattern = item.partition("=")
        if not eq or not name or not pattern:
            raise SystemExit(f"--split {item!r}: expected NAME=PATTERN, e.g. train='train-*.tar'")
        splits[name] = pattern
    classes = None
    if args.classes:
        classes = read_classes(args.classes)
    manifest = index_shards(
        args.source, args.out, IndexOptions(splits, classes, workers=args.workers)
    )
    order = manifest.source.get("label_order", {})
    for name, split in manifest.splits.items():
        kinds = ", ".join(f"{n} ({f.kind})" for n, f in split.field_specs.items())
        line = f"{name}: {split.num_samples} samples in {len(split.shards)} tars; fields {kinds}"
        if name in order:
            ordered = " (ordered: see the warning)" if order[name] > ORDERED_LABELS else ""
            line += f"; label_order {order[name]:.2f}{ordered}"
        print(line)
    where = manifest.data_root or manifest.root
    print(f"wrote {manifest.root}/{MANIFEST_NAME} (tars read from {where})")
    return 0
