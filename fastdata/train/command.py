"""``fastdata train PIPELINE``: the training pipelines on the fastdata command line.

    fastdata train cifar100 [--data ARCHIVE | --download] [--out DIR] [--epochs N] ...

Each pipeline lives in ``pipelines/<name>/`` and lends its own argument parser (``add_arguments``)
and entry point (``run``), so ``python -m pipelines.<name>`` and this command take the same options.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["PIPELINES", "register"]

#: Pipeline name -> (module with `add_arguments(parser)` and `run(args)`, one-line help).
PIPELINES: dict[str, tuple[str, str]] = {
    "cifar100": (
        "pipelines.cifar100.train",
        "ResNet on CIFAR-100: shard once, train, print a per-epoch table",
    ),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train`` (with one subcommand per pipeline) to the ``fastdata`` command line."""
    train = subparsers.add_parser(
        "train", help="run a training pipeline", description=__doc__.split("\n\n")[0]
    )
    pipelines = train.add_subparsers(dest="pipeline", required=True)
    for name, (module_name, help_text) in PIPELINES.items():
        module = importlib.import_module(module_name)
        parser = pipelines.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(parser)
        parser.set_defaults(func=_runner(module))


def _runner(module: object) -> object:
    def run(args: argparse.Namespace) -> int:
        module.run(args)
        return 0

    return run
