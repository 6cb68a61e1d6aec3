"""The `fastdata` command line: a thin layer over library functions.

fastdata shard SOURCE INPUT... OUT [options]  # cifar10 | cifar100 | folder | list | coco | segmentation
fastdata shard SOURCE INPUT OUT --part I/N  # part I of N, on any machine; then:
fastdata merge OUT                          # check the parts, write the manifest
fastdata index DIR_OR_URL [--out OUT]       # other tools' WebDataset tars, read in place
fastdata inspect OUT
fastdata verify OUT
fastdata tune OUT [--sweep]
fastdata train cifar100 [--data ARCHIVE | --download] [options]

Each command's glue is in this package (`shard` and `merge`: `fastdata.cli.shard`; `index`:
`fastdata.cli.index`; `train`: `fastdata.cli.train`; `inspect`, `verify` and the parser: here),
except `tune`'s, which registers itself from `fastdata.tune.command`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from fastdata._util.version import __version__
from fastdata.cli.index import add_index
from fastdata.cli.shard import add_shard
from fastdata.cli.train import add_train

__all__ = ["BUILTIN_COMMANDS", "EXTERNAL_COMMANDS", "build_parser", "main"]

# Subcommands that live with their feature: "module:function" taking the subparsers object.
# Only `tune`, whose module imports torch (and is being reworked in issue 38's tune part);
# every other command's glue is this package's (`shard`, `index`, `train`, ...).
EXTERNAL_COMMANDS = {
    "tune": "fastdata.tune.command:register",
}


#: Commands defined in this package: running one imports no feature command (`tune` imports
#: torch: seconds of start-up that `fastdata shard` does not need). `train` imports its
#: pipeline (and Lightning) only when it runs.
BUILTIN_COMMANDS = ("shard", "merge", "index", "inspect", "verify", "train")


def build_parser(features: bool = True) -> argparse.ArgumentParser:
    """The `fastdata` parser; `features=False` leaves out `EXTERNAL_COMMANDS` (not imported)."""
    parser = argparse.ArgumentParser(prog="fastdata", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"fastdata {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    add_shard(sub)
    add_index(sub)
    add_train(sub)
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
