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


# -- detection creates no CUDA context (ddp_fork / ddp_notebook need a fork-safe parent) --------


@pytest.fixture
def cuda_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every call that would create a CUDA context in this process (and fails it)."""
    import torch

    calls: list[str] = []

    def forbidden(name: str):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} creates a CUDA context")

        return call

    monkeypatch.setattr(torch.cuda, "get_device_capability", forbidden("get_device_capability"))
    monkeypatch.setattr(torch.cuda, "_lazy_init", forbidden("_lazy_init"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return calls


def test_detect_hardware_reads_the_capability_from_nvml(monkeypatch, cuda_calls) -> None:
    from fastdata.train import precision

    def no_pynvml(index: int) -> tuple[int, int]:
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(precision, "_capability_pynvml", no_pynvml)
    monkeypatch.setattr(precision, "_capability_libnvml", lambda index: (9, 0))
    assert detect_hardware().cuda_capability == (9, 0)
    assert cuda_calls == []


def test_without_nvml_the_capability_comes_from_a_child_process(monkeypatch, cuda_calls) -> None:
    import torch

    from fastdata.train import precision

    def fails(index: int) -> tuple[int, int]:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(precision, "_capability_pynvml", fails)
    monkeypatch.setattr(precision, "_capability_libnvml", fails)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(precision, "_capability_child", lambda: (8, 6))
    assert precision.cuda_capability() == (8, 6)

    def child_fails() -> tuple[int, int]:
        raise RuntimeError("no driver")

    monkeypatch.setattr(precision, "_capability_child", child_fails)
    with pytest.raises(RuntimeError, match="libnvidia-ml.*no driver.*explicit precision"):
        precision.cuda_capability()
    assert cuda_calls == []


@pytest.mark.parametrize("requested", ["32-true", "auto"])
def test_make_trainer_creates_no_cuda_context(monkeypatch, cuda_calls, requested) -> None:
    import torch

    from fastdata.train import TrainPreset, make_trainer, precision

    monkeypatch.setattr(precision, "_capability_pynvml", lambda index: (9, 0))
    trainer = make_trainer(
        TrainPreset(precision=requested),
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    assert trainer is not None and cuda_calls == []
    assert not torch.cuda.is_initialized()


def test_importing_fastdata_train_leaves_cuda_uninitialized() -> None:
    import subprocess
    import sys

    code = (
        "import torch, fastdata.train as t; "
        "t.make_trainer(t.TrainPreset(precision='auto'), accelerator='cpu', logger=False, "
        "enable_checkpointing=False); assert not torch.cuda.is_initialized(); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
