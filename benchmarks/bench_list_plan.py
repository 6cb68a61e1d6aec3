"""Peak memory of `fastdata shard list` as the list grows: flat in the number of rows?

    python benchmarks/bench_list_plan.py [--rows 100000,1000000,3000000] [--workers 2] [--out DIR]

Each row count runs the real command, `fastdata shard list LIST OUT --workers W --no-progress`,
under `/usr/bin/time -f %M`: the peak RSS of the command's process tree as wait4 reports it (the
largest of the driver and its forked writer processes). A second column runs only what the
driver does before any shard is written (`ListSource(LIST)`, then `plan_jobs`), a third the
interpreter importing fastdata's CLI and stopping (the floor every run pays). The list points
at four 8x8 PNG files, repeated (writing is then cheap; the rows are what grows). The last line
is the ratio of the largest to the smallest peak: the issue's bar is 1.2 ("flat within 20%").
The output folders are removed after each run (3M rows write ~9 GB).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

_PLAN = """
import sys
from fastdata.write.sources import ListSource
from fastdata.write.plan import plan_jobs
from fastdata.write.writer import ShardOptions
jobs = plan_jobs(ListSource(sys.argv[1]), ShardOptions(seed=0))
print(sum(job.count for job in jobs))
"""
_IMPORTS = "import fastdata.cli"


def cpu_model() -> str:
    """The CPU's model name (benchmarks record it: machines differ between runs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _write_list(folder: Path, rows: int) -> Path:
    images = folder / "img"
    images.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(images / f"{i}.png")
    path = folder / f"list-{rows}.csv"
    with path.open("w") as file:
        file.write("path,label,split\n")
        for start in range(0, rows, 100_000):
            file.write(
                "".join(
                    f"img/{i % 4}.png,{i % 100},{'val' if i % 10 == 0 else 'train'}\n"
                    for i in range(start, min(start + 100_000, rows))
                )
            )
    return path


def _peak(command: list[str], scratch: Path) -> tuple[int, float]:
    """(peak RSS in MiB, seconds) of `command`."""
    rss_file = scratch / "rss.txt"
    start = time.perf_counter()
    subprocess.run(
        ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *command],
        check=True,
        capture_output=True,
        timeout=3600,
    )
    seconds = time.perf_counter() - start
    return int(rss_file.read_text().split()[-1]) // 1024, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="100000,1000000,3000000")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="scratch folder (default: tmp)")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; Python {platform.python_version()}; workers {args.workers}")
    fastdata = [sys.executable, "-m", "fastdata"]
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        scratch = Path(tmp)
        floor, _ = _peak([sys.executable, "-c", _IMPORTS], scratch)
        print(f"imports only: {floor} MiB\n")
        print("| rows | `fastdata shard list` peak MiB | seconds | plan only peak MiB |")
        print("|---|---|---|---|")
        peaks = []
        for rows in (int(n) for n in args.rows.split(",") if n):
            list_path = _write_list(scratch, rows)
            out = scratch / "out"
            command = [*fastdata, "shard", "list", str(list_path), str(out)]
            rss, seconds = _peak(
                [*command, "--workers", str(args.workers), "--no-progress"], scratch
            )
            shutil.rmtree(out)
            plan, _ = _peak([sys.executable, "-c", _PLAN, str(list_path)], scratch)
            peaks.append(rss)
            print(f"| {rows:,} | {rss} | {seconds:.1f} | {plan} |", flush=True)
            list_path.unlink()
        print(f"\nlargest / smallest peak of the command: {max(peaks) / min(peaks):.2f}")


if __name__ == "__main__":
    main()
