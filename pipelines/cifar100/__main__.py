"""``python -m pipelines.cifar100``: see `pipelines.cifar100`."""

import sys

from .train import main

if __name__ == "__main__":
    sys.exit(main())
