"""``fastdata train PIPELINE``: the training pipelines on the fastdata command line.

    fastdata train cifar100 [--data ARCHIVE | --download] [--out DIR] [--epochs N] ...

The library never imports its applications at start-up: pipelines register themselves as entry
points of the group ``fastdata.pipelines`` (this repository's ``pipelines/`` folder installs as
the package ``fastdata_pipelines``; see pyproject.toml), each a module with `add_arguments(parser)`
and `run(args)`. Building the command line only lists the entry points' names; the chosen
pipeline is imported when it runs, and parses its own options, so ``python -m pipelines.<name>``
and this command take the same ones.
"""

from __future__ import annotations

import argparse
import importlib
from importlib.metadata import entry_points

__all__ = ["GROUP", "add_train", "available_pipelines"]

GROUP = "fastdata.pipelines"


def available_pipelines() -> dict[str, str]:
    """Pipeline name -> module, from the installed entry points (nothing is imported)."""
    return {ep.name: ep.value for ep in entry_points(group=GROUP)}


def add_train(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train NAME [options]`` to the ``fastdata`` command line."""
    names = available_pipelines()
    train = subparsers.add_parser(
        "train",
        help="run a training pipeline",
        description=__doc__.split("\n\n")[0] + f" Pipelines: {', '.join(sorted(names)) or 'none'}.",
    )
    train.add_argument("pipeline", help=f"one of: {', '.join(sorted(names)) or '(none installed)'}")
    train.add_argument("options", nargs=argparse.REMAINDER, help="the pipeline's own options")
    train.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    names = available_pipelines()
    if args.pipeline not in names:
        raise SystemExit(
            f"fastdata train: unknown pipeline {args.pipeline!r}; installed: {sorted(names)} "
            "(pipelines register under the entry-point group 'fastdata.pipelines')"
        )
    module = importlib.import_module(names[args.pipeline])
    parser = argparse.ArgumentParser(prog=f"fastdata train {args.pipeline}")
    module.add_arguments(parser)
    module.run(parser.parse_args(args.options))
    return 0
