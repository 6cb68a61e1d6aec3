"""Bring the real data (and DALI) to the bare, offline GPU machine, then run the GPU check there.

The device tool sends the working tree plus `carry`-named ignored paths, at most 64 MiB per call,
and keeps the machine warm for about 30 s after a call. So, here::

    echo /.gpu-parts/ >> .git/info/exclude; echo /.gpu-data/ >> .git/info/exclude
    python benchmarks/gpu_parts.py prepare                  # CIFAR-100 parts + clothing-small
    python benchmarks/gpu_parts.py prepare --dali-wheels /tmp/dali-wheels   # DALI too

``prepare`` copies clothing-small (43 MB) to ``.gpu-data/``, splits the CIFAR-100 archive (and a
tar of the DALI wheels) into parts small enough to travel beside the working tree, writes
``.gpu-parts/parts.json`` (MD5 of every part and whole), and prints the device calls in order:
one ``stash`` call per part (each copies its part to /tmp/fastdata-parts on the machine, MD5-
checked; make the next call within the ~30 s the machine stays warm), then one ``device-run``
call that carries clothing-small, reassembles and MD5-checks every whole, installs the DALI wheels
(if sent) into /tmp/fastdata-site, runs ``gpu_check.py`` and ``pytest -m gpu``, all under $OUT.
Without the parts, ``device-run`` still runs the check on whatever did arrive (synthetic data for
the rest).

DALI for CUDA 13 (checked 2026-11-30: ``nvidia-dali-cuda130`` 2.4.0, py3-none-manylinux_2_28_x86_64,
198.7 MB; the machine lacks its dependencies astunparse, gast, optree, nvtx, makefun, libcst,
nvidia-nvimgcodec-cu13, nvidia-libnvcomp-cu13, nvidia-nvjpeg, nvidia-nvjpeg2k-cu13,
nvidia-nvtiff-cu13): download them into one folder with ``pip download --no-deps
--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 ... -d DIR NAME``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = Path(".gpu-parts")  # relative to the repository root: `carry` takes such paths
DATA = Path(".gpu-data")
DEVICE_PARTS = Path("/tmp/fastdata-parts")
DEVICE_DATA = Path("/tmp/fastdata-data")
DEVICE_SITE = Path("/tmp/fastdata-site")
CALL_LIMIT = 64 * 2**20
MiB = 2**20
MAX_PART_MIB = 59  # parts stay under 60 MiB: room for the working tree in a 64 MiB call
CALL_S = 570  # one device call's command limit is 600 s: check + GPU tests fit in this


def md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_bytes() -> int:
    """Bytes of what every device call sends anyway: tracked and untracked-not-ignored files."""
    names = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    return sum(
        (REPO / n.decode()).stat().st_size for n in names if n and (REPO / n.decode()).is_file()
    )


def split(path: Path, name: str, part_bytes: int) -> dict:
    """Split `path` into PARTS/name.partNN; returns its entry of parts.json."""
    entry = {"file": path.name, "size": path.stat().st_size, "md5": md5(path), "parts": []}
    with open(path, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            part = REPO / PARTS / f"{name}.part{i:02d}"
            part.write_bytes(block)
            entry["parts"].append({"path": str(PARTS / part.name), "md5": md5(part)})
    return entry


def prepare(args: argparse.Namespace) -> None:
    for folder in (PARTS, DATA):
        ignored = subprocess.run(["git", "check-ignore", "-q", str(folder) + "/"], cwd=REPO)
        if ignored.returncode != 0:
            sys.exit(f"{folder}/ is not ignored: `echo /{folder}/ >> .git/info/exclude` first")
    if not 8 <= args.part_mib <= MAX_PART_MIB:
        sys.exit(f"--part-mib must be 8..{MAX_PART_MIB} (parts under 60 MiB), got {args.part_mib}")
    base = tree_bytes()
    part_bytes = min(args.part_mib * MiB, CALL_LIMIT - base - 2 * MiB)
    if part_bytes < 8 * MiB:
        sys.exit(
            f"the working tree already sends {base / MiB:.1f} MiB per call: too little room. "
            "Untracked files that are not ignored travel too (`git status --short` lists them): "
            "ignore them in .git/info/exclude"
        )
    shutil.rmtree(REPO / PARTS, ignore_errors=True)
    (REPO / PARTS).mkdir()
    wholes = {"cifar": split(args.data_dir / "cifar-100-python.tar.gz", "cifar", part_bytes)}
    if args.dali_wheels:
        wheels = REPO / PARTS / "dali-wheels.tar"
        with tarfile.open(wheels, "w") as tar:
            for wheel in sorted(Path(args.dali_wheels).glob("*.whl")):
                tar.add(wheel, arcname=wheel.name)
        wholes["dali"] = split(wheels, "dali", part_bytes)
        wheels.unlink()
    (REPO / PARTS / "parts.json").write_text(json.dumps(wholes, indent=1) + "\n")
    shutil.rmtree(REPO / DATA, ignore_errors=True)
    shutil.copytree(args.data_dir / "clothing-small", REPO / DATA / "clothing-small")
    print_calls(wholes, base, args.budget_s)


def print_calls(wholes: dict, base: int, budget_s: int) -> None:
    calls = []
    for entry in wholes.values():
        for part in entry["parts"]:
            command = f"python3 benchmarks/gpu_parts.py stash {part['path']}"
            calls.append({"command": command, "carry": [part["path"], str(PARTS / "parts.json")],
                          "timeout_s": 120})  # fmt: skip
    run = f"python3 benchmarks/gpu_parts.py device-run --budget-s {budget_s}"
    calls.append({"command": run, "carry": [str(DATA), str(PARTS / "parts.json")],
                  "timeout_s": 600})  # fmt: skip
    print(f"working tree per call: {base / MiB:.1f} MiB (limit 64 MiB)")
    print(f"{len(calls)} device calls, in this order; make each within ~30 s of the last reply")
    print(f"(device time: ~1-2 min start + ~20-40 s per stash call + {budget_s} s check):")
    for i, call in enumerate(calls, 1):
        print(f"{i:>2}. run {json.dumps(call)}")


def stash(args: argparse.Namespace) -> None:
    """On the device: keep one carried part outside the repository copy, MD5-checked."""
    wholes = json.loads((REPO / PARTS / "parts.json").read_text())
    expected = {p["path"]: p["md5"] for w in wholes.values() for p in w["parts"]}
    part = REPO / args.part
    if md5(part) != expected[args.part]:
        sys.exit(f"{args.part}: MD5 mismatch (expected {expected[args.part]}): send it again")
    DEVICE_PARTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(part, DEVICE_PARTS / part.name)
    print(f"stashed {part.name} ({part.stat().st_size / MiB:.1f} MiB), MD5 ok")


def assemble(entry: dict) -> Path | None:
    """Join a whole from the stashed parts and check its MD5; None when a part is missing."""
    parts = [DEVICE_PARTS / Path(p["path"]).name for p in entry["parts"]]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        print(f"{entry['file']}: parts {missing} were not sent: going on without it")
        return None
    whole = DEVICE_DATA / entry["file"]
    DEVICE_DATA.mkdir(parents=True, exist_ok=True)
    with open(whole, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    if md5(whole) != entry["md5"]:
        whole.unlink()
        print(f"{entry['file']}: MD5 mismatch after joining: going on without it")
        return None
    print(f"{entry['file']}: {whole.stat().st_size / MiB:.1f} MiB, MD5 ok")
    return whole


def device_run(args: argparse.Namespace) -> None:
    """On the device: reassemble, install DALI if sent, run the check and the GPU tests, all
    within `CALL_S` (the GPU tests get what the check leaves)."""
    import time

    start = time.monotonic()
    out = Path(os.environ.get("OUT", "gpu-out"))
    wholes = json.loads((REPO / PARTS / "parts.json").read_text())
    wholes = {k: assemble(v) for k, v in wholes.items()}
    env = {**os.environ, "FASTDATA_DATA_DIR": str(DEVICE_DATA), "PYTHONUNBUFFERED": "1"}
    # The machine has the tree, not an install: `fastdata_pipelines` (pipelines/ under the name
    # pyproject gives it) comes from a link, for the check and for the tests' conftest alike.
    shim = DEVICE_DATA / "shim"
    shim.mkdir(parents=True, exist_ok=True)
    if not (shim / "fastdata_pipelines").exists():
        (shim / "fastdata_pipelines").symlink_to(REPO / "pipelines", target_is_directory=True)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(shim), str(REPO), env.get("PYTHONPATH", "")) if p
    )
    if (REPO / DATA / "clothing-small").exists():
        DEVICE_DATA.mkdir(parents=True, exist_ok=True)
        link = DEVICE_DATA / "clothing-small"
        if not link.exists():
            link.symlink_to(REPO / DATA / "clothing-small")
    if wholes.get("dali"):
        wheel_dir = DEVICE_DATA / "wheels"
        with tarfile.open(wholes["dali"]) as tar:
            tar.extractall(wheel_dir, filter="data")
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        pip += ["--target", str(DEVICE_SITE), *map(str, sorted(wheel_dir.glob("*.whl")))]
        if subprocess.run(pip).returncode == 0:
            env["PYTHONPATH"] = os.pathsep.join([str(DEVICE_SITE), env.get("PYTHONPATH", "")])
    check = [sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--out", str(out)]
    subprocess.run([*check, "--budget-s", str(args.budget_s)], env=env, cwd=REPO)
    left = CALL_S - (time.monotonic() - start)
    if left < 30:
        (out / "pytest_gpu.log").write_text(f"not run: {left:.0f} s left of the call\n")
        return
    with open(out / "pytest_gpu.log", "w") as log:
        tests = [sys.executable, "-m", "pytest", "-q", "-m", "gpu or dali", "--timeout", "120"]
        try:
            subprocess.run(tests, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                           timeout=left)  # fmt: skip
        except subprocess.TimeoutExpired:
            log.write(f"\ncut after {left:.0f} s: the device call's limit\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="here: write the parts and print the device calls")
    prep.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    prep.add_argument("--dali-wheels", type=Path, default=None, help="folder of DALI wheels")
    prep.add_argument("--part-mib", type=int, default=56)
    prep.add_argument("--budget-s", type=int, default=420, help="the check's own budget")
    st = sub.add_parser("stash", help="on the device: keep a carried part in /tmp")
    st.add_argument("part")
    run = sub.add_parser("device-run", help="on the device: join, install, check")
    run.add_argument("--budget-s", type=int, default=420)
    args = p.parse_args(argv)
    {"prepare": prepare, "stash": stash, "device-run": device_run}[args.command](args)


if __name__ == "__main__":
    main()
