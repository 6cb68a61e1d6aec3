"""Activation checkpointing: activation bytes saved for backward, and the fwd+bwd time it costs.

    python benchmarks/bench_checkpointing.py                       # CPU, small batch
    python benchmarks/bench_checkpointing.py --device cuda --batch-size 256 --json out.json

For each model (the CIFAR ResNet-9 / ResNet-18 of pipelines.cifar100, and a ViT-style stack of
transformer blocks) it measures, without and with `fastdata.train.apply_activation_checkpointing`:
the bytes autograd saves for backward (`SavedTensorMeter`, parameters excluded), the fastest of
several forward + backward passes after warm-up (with and without timed in turns), and on CUDA the
peak allocated memory. Prints a table and writes JSON with the versions, host and git revision.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from common import environment  # noqa: E402  (run as a script: benchmarks/ is on sys.path)

from fastdata.train.checkpointing import SavedTensorMeter, apply_activation_checkpointing  # noqa: E402
from pipelines.cifar100.model import ModelConfig, build_model  # noqa: E402


# ----------------------------------------------------------------------------- models
class _Tokens(nn.Module):
    def __init__(self, dim: int, patch: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class _Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def vit_stack(
    dim: int = 192, depth: int = 6, heads: int = 3, patch: int = 4, classes: int = 100
) -> nn.Module:
    """A ViT-Tiny-like stack on 32x32 images: 4x4 patches, pre-norm transformer blocks."""
    block = nn.TransformerEncoderLayer(
        dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
    )
    return nn.Sequential(
        _Tokens(dim, patch),
        nn.TransformerEncoder(block, depth, enable_nested_tensor=False),
        nn.LayerNorm(dim),
        _Pool(),
        nn.Linear(dim, classes),
    )


MODELS: dict[str, Callable[[int], nn.Module]] = {
    "resnet9": lambda width: build_model(ModelConfig("resnet9", width)),
    "resnet18": lambda width: build_model(ModelConfig("resnet18", width)),
    "vit": lambda width: vit_stack(dim=3 * width),
}


# ----------------------------------------------------------------------------- measurement
def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of activations autograd keeps for backward in one training step."""
    meter = SavedTensorMeter(exclude=model.parameters())
    with meter.measure():
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return meter.bytes


def step_times(
    models: list[nn.Module], x: torch.Tensor, y: torch.Tensor, repeats: int
) -> list[float]:
    """Fastest fwd+bwd seconds of each model, timed in turns so that they share the same machine
    load (the minimum is the figure least disturbed by other processes)."""
    for model in models:
        _step(model, x, y)  # warm-up
    best = [float("inf")] * len(models)
    for _ in range(repeats):
        for i, model in enumerate(models):
            _sync(x.device)
            t0 = time.perf_counter()
            _step(model, x, y)
            _sync(x.device)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def peak_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int | None:
    """Peak CUDA memory of one training step (None on CPU)."""
    if x.device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(x.device)
    _step(model, x, y)
    return torch.cuda.max_memory_allocated(x.device)


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    plain = MODELS[name](args.width).to(device)
    x = torch.randn(args.batch_size, 3, 32, 32, device=device)
    y = torch.randint(0, 100, (args.batch_size,), device=device)
    wrapped = copy.deepcopy(plain)
    blocks = apply_activation_checkpointing(wrapped, True)
    saved_off, saved_on = saved_bytes(plain, x, y), saved_bytes(wrapped, x, y)
    t_off, t_on = step_times([plain, wrapped], x, y, args.repeats)
    peak_off, peak_on = peak_bytes(plain, x, y), peak_bytes(wrapped, x, y)
    mib = 2**20
    return {
        "model": name,
        "blocks": len(blocks),
        "batch_size": args.batch_size,
        "saved_mib_off": saved_off / mib,
        "saved_mib_on": saved_on / mib,
        "saved_reduction": 1 - saved_on / saved_off,
        "step_ms_off": 1e3 * t_off,
        "step_ms_on": 1e3 * t_on,
        "time_overhead": t_on / t_off - 1,
        "peak_mib_off": peak_off / mib if peak_off else None,
        "peak_mib_on": peak_on / mib if peak_on else None,
    }


# ----------------------------------------------------------------------------- report
def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'model':<9} {'blocks':>6} {'saved MiB':>17} {'reduction':>9} {'fwd+bwd ms':>19} {'overhead':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['model']:<9} {r['blocks']:>6} {r['saved_mib_off']:>8.1f} -> {r['saved_mib_on']:>5.1f} "
            f"{r['saved_reduction']:>9.0%} {r['step_ms_off']:>8.1f} -> {r['step_ms_on']:>7.1f} "
            f"{r['time_overhead']:>+8.0%}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--width", type=int, default=16, help="ResNet width; the ViT uses dim = 3 x width"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = [bench_model(name, args) for name in args.models]
    print(format_table(rows))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "env": environment({"threads": torch.get_num_threads()}),
                    "results": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return rows


if __name__ == "__main__":
    main(parse_args())
