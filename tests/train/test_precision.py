"""precision="auto": one test per branch of the rule, plus the CPU flag reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdata.train.precision import (
    HardwareFacts,
    cpu_has_native_bf16,
    detect_hardware,
    resolve_precision,
)

AMPERE = HardwareFacts(cuda_capability=(8, 0), cpu_bf16=False)
HOPPER = HardwareFacts(cuda_capability=(9, 0), cpu_bf16=True)
TURING = HardwareFacts(cuda_capability=(7, 5), cpu_bf16=False)
CPU_BF16 = HardwareFacts(cuda_capability=None, cpu_bf16=True)
CPU_PLAIN = HardwareFacts(cuda_capability=None, cpu_bf16=False)


@pytest.mark.parametrize(
    ("facts", "accelerator", "expected"),
    [
        (AMPERE, "auto", "bf16-mixed"),
        (HOPPER, "gpu", "bf16-mixed"),
        (TURING, "auto", "16-mixed"),
        (TURING, "cuda", "16-mixed"),
        (CPU_BF16, "auto", "bf16-mixed"),
        (CPU_PLAIN, "auto", "32-true"),
        (TURING, "cpu", "32-true"),  # a GPU machine told to train on its CPU
        (HOPPER, "cpu", "bf16-mixed"),
    ],
)
def test_auto_rule(facts: HardwareFacts, accelerator: str, expected: str) -> None:
    assert resolve_precision("auto", facts, accelerator) == expected


def test_explicit_precision_passes_through_and_bad_one_is_named() -> None:
    assert resolve_precision("16-mixed", CPU_PLAIN) == "16-mixed"
    with pytest.raises(ValueError, match="'bf17'"):
        resolve_precision("bf17", CPU_PLAIN)


def test_gpu_accelerator_without_gpu_is_an_error() -> None:
    with pytest.raises(ValueError, match="no CUDA GPU"):
        resolve_precision("auto", CPU_BF16, "gpu")


def test_cpu_flags(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n")
    assert cpu_has_native_bf16(plain) is False
    assert cpu_has_native_bf16(amx) is True
    assert cpu_has_native_bf16(tmp_path / "missing") is False


def test_detect_hardware_matches_torch() -> None:
    import torch

    facts = detect_hardware()
    assert (facts.cuda_capability is not None) == torch.cuda.is_available()
    assert isinstance(facts.cpu_bf16, bool)
