"""Peak RSS of the planning phase of `fastdata shard list`: open the list, plan the shards.

    python benchmarks/bench_list_plan.py [--rows 100000,1000000,3000000] [--out DIR]

Each row count runs in its own process under `/usr/bin/time -f %M` (the process's peak RSS):
`ListSource(LIST)` then `plan_jobs(source, ShardOptions(seed=0))`, what the driver does before
any shard is written (writing is measured by bench_engine.py). The list points at four tiny
image files, repeated; the first row of the table is the same process importing fastdata and
stopping there (the floor every run pays).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PLAN = """
import sys
from fastdata.write.sources import ListSource
from fastdata.write.writer import ShardOptions, plan_jobs
if sys.argv[1] != "-":
    jobs = plan_jobs(ListSource(sys.argv[1]), ShardOptions(seed=0))
    print(sum(len(job.sample_ids) for job in jobs))
"""


def _write_list(path: Path, rows: int) -> None:
    with path.open("w") as file:
        file.write("path,label,split\n")
        for start in range(0, rows, 100_000):
            file.write(
                "".join(
                    f"img/{i % 4}.png,{i % 100},{'val' if i % 10 == 0 else 'train'}\n"
                    for i in range(start, min(start + 100_000, rows))
                )
            )


def _peak_rss_mib(list_path: str, scratch: Path) -> tuple[int, float]:
    rss_file = scratch / "rss.txt"
    command = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), sys.executable, "-c", _PLAN]
    start = time.perf_counter()
    subprocess.run([*command, list_path], check=True, capture_output=True, timeout=1800)
    seconds = time.perf_counter() - start
    return int(rss_file.read_text().split()[-1]) // 1024, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="100000,1000000,3000000")
    parser.add_argument("--out", type=Path, default=None, help="scratch folder (default: tmp)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        scratch = Path(tmp)
        floor, _ = _peak_rss_mib("-", scratch)
        print("| rows | peak RSS MiB | above imports MiB | seconds |\n|---|---|---|---|")
        print(f"| 0 (imports only) | {floor} | 0 | - |")
        for rows in (int(n) for n in args.rows.split(",") if n):
            list_path = scratch / f"list-{rows}.csv"
            _write_list(list_path, rows)
            rss, seconds = _peak_rss_mib(str(list_path), scratch)
            print(f"| {rows:,} | {rss} | {rss - floor} | {seconds:.1f} |", flush=True)
            list_path.unlink()


if __name__ == "__main__":
    main()
