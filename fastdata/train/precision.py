"""Choosing the training precision from the hardware (``precision="auto"``).

The rule (`resolve_precision`) is a pure function of `HardwareFacts`, so every branch is testable
on any machine; `detect_hardware` reads the facts of this one.

| training device                                    | "auto" gives   | why |
|----------------------------------------------------|----------------|-----|
| CUDA GPU, compute capability >= 8.0 (Ampere+)      | "bf16-mixed"   | bf16 tensor cores; fp32's range, so no loss scaling |
| older CUDA GPU (Volta, Turing)                     | "16-mixed"     | fp16 tensor cores (with loss scaling); no fast bf16 |
| CPU with native bf16 (AVX512-BF16 or AMX-BF16)     | "bf16-mixed"   | oneDNN runs bf16 convs / matmuls in hardware |
| any other CPU                                      | "32-true"      | bf16 is emulated: slower than fp32, not faster |

"Native bf16 on the CPU" is read from the x86 CPU flags (``avx512_bf16`` / ``amx_bf16`` in
/proc/cpuinfo on Linux; other CPUs and systems count as no). It is not "a bf16 matmul runs": that
always works, emulated, and emulation is slow. Measured on a 2-core AVX2 AMD EPYC without bf16
flags, one thread, the CIFAR ResNet-9 (width 16, batch 256, channels_last): one fwd+bwd took
0.70 s of CPU in fp32 and 9.3 s under bf16 autocast.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "PRECISIONS",
    "HardwareFacts",
    "cpu_has_native_bf16",
    "detect_hardware",
    "resolve_precision",
]

#: Precisions Lightning accepts as strings (besides "auto").
PRECISIONS = frozenset(
    {
        "64-true",
        "32-true",
        "16-true",
        "bf16-true",
        "16-mixed",
        "bf16-mixed",
        "transformer-engine",
        "transformer-engine-float16",
    }
)
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_GPU_ACCELERATORS = frozenset({"gpu", "cuda"})


@dataclass(frozen=True)
class HardwareFacts:
    """What the precision rule needs to know about a machine.

    Args:
        cuda_capability: (major, minor) compute capability of the first visible CUDA GPU, or
            None without CUDA.
        cpu_bf16: the CPU computes bf16 natively (AVX512-BF16 or AMX).
    """

    cuda_capability: tuple[int, int] | None
    cpu_bf16: bool


def resolve_precision(requested: str, facts: HardwareFacts, accelerator: str = "auto") -> str:
    """The Lightning precision string for `requested` ("auto" or an explicit one) on `facts`.

    Args:
        requested: "auto", or one of `PRECISIONS` (returned unchanged).
        facts: the machine (see `detect_hardware`).
        accelerator: the Trainer's accelerator; "auto" trains on CUDA when there is a GPU.

    Raises:
        ValueError: for a precision Lightning does not know, or "cuda"/"gpu" without a GPU.
    """
    if requested != "auto":
        if requested not in PRECISIONS:
            raise ValueError(
                f"precision must be 'auto' or one of {sorted(PRECISIONS)}, got {requested!r}"
            )
        return requested
    on_gpu = accelerator in _GPU_ACCELERATORS or (
        accelerator == "auto" and facts.cuda_capability is not None
    )
    if on_gpu:
        if facts.cuda_capability is None:
            raise ValueError(f"accelerator={accelerator!r} but no CUDA GPU is visible")
        return "bf16-mixed" if facts.cuda_capability >= (8, 0) else "16-mixed"
    return "bf16-mixed" if facts.cpu_bf16 else "32-true"


def detect_hardware() -> HardwareFacts:
    """The `HardwareFacts` of this machine (first visible GPU; CPU flags)."""
    capability = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
    return HardwareFacts(cuda_capability=capability, cpu_bf16=cpu_has_native_bf16())


@functools.cache
def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True when the CPU flags list AVX512-BF16 or AMX-BF16 (Linux); False where unknown."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return not _BF16_CPU_FLAGS.isdisjoint(line.split(":", 1)[-1].split())
    return False
