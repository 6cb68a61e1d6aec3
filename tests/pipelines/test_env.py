"""The machine record of every benchmark: which CPU a ratio was measured on."""

from __future__ import annotations

from pathlib import Path

from fastdata_pipelines.env import cpu_description

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_tile amx_bf16 amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse4_2
"""

AMD = """processor\t: 0
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_bf16 avx512_vnni
"""

ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes sve
CPU implementer\t: 0x41
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return path


def test_model_and_matrix_features_tell_an_amx_xeon_from_an_epyc(tmp_path: Path) -> None:
    intel = cpu_description(_write(tmp_path, INTEL))
    assert intel["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert intel["flags"] == sorted(
        ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"]
        + ["amx_tile", "amx_bf16", "amx_int8"]
    )  # the first core's flags, only the listed features
    amd = cpu_description(_write(tmp_path, AMD))
    assert amd["model"].startswith("AMD EPYC") and "amx_bf16" not in amd["flags"]
    assert "avx512_bf16" in amd["flags"]


def test_arm_features_and_no_index_as_model(tmp_path: Path) -> None:
    arm = cpu_description(_write(tmp_path, ARM))
    assert arm["model"] != "0" and arm["flags"] == ["asimd", "sve"]


def test_unreadable_cpuinfo_still_names_something(tmp_path: Path) -> None:
    found = cpu_description(tmp_path / "absent")
    assert found["flags"] is None and isinstance(found["model"], str) and found["model"]


def test_the_benchmark_environment_records_the_cpu() -> None:
    from benchmarks.common import environment

    env = environment()
    assert env["cpu"]["model"] and "machine" in env["cpu"]
