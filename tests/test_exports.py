"""What `fastdata` exports: the names the docs use, each from one public path."""

from __future__ import annotations

import subprocess
import sys

import fastdata


def test_documented_names_import_from_the_top_level():
    from fastdata.augment import Preset
    from fastdata.read.base import WorkerSettings
    from fastdata.read.verify import verify
    from fastdata.write.index import index_shards

    assert fastdata.Preset is Preset  # train_transforms=Preset(...), docs/guides/transforms.md
    assert fastdata.verify is verify and fastdata.index_shards is index_shards  # the commands'
    assert fastdata.WorkerSettings is WorkerSettings
    assert {"Preset", "verify", "index_shards", "pil_info"} <= set(fastdata.__all__)


def test_the_new_exports_stay_lazy():
    # `import fastdata` must not import torch (nor DALI) for the names it lists.
    code = "import sys, fastdata; print('torch' in sys.modules, 'nvidia.dali' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]
