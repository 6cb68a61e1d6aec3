"""Draw bar charts (PNG) from benchmark JSON results, with Pillow-SIMD's ImageDraw only.

    python benchmarks/plot.py benchmarks/results/bench_loader.json [--out DIR]

No matplotlib: it depends on plain `pillow`, which must not be installed beside Pillow-SIMD.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

BAR_COLORS = [
    (70, 110, 180),
    (230, 140, 50),
    (80, 160, 90),
    (190, 70, 70),
    (130, 100, 170),
    (120, 120, 120),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="bench_*.json files")
    p.add_argument(
        "--out", type=Path, default=None, help="folder for PNGs (default: beside each JSON)"
    )
    return p.parse_args(argv)


def bar_chart(title: str, labels: list[str], values: list[float], unit: str, path: Path) -> Path:
    """A horizontal bar chart, one bar per label, values printed at the bar ends."""
    font = ImageFont.load_default()
    row, left, width = 34, 330, 980
    height = 60 + row * len(labels) + 20
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((12, 12), title, fill="black", font=font)
    top = max(values) if values and max(values) > 0 else 1.0
    span = width - left - 140
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        y = 50 + i * row
        draw.text((12, y + 8), label[:52], fill="black", font=font)
        length = int(span * value / top)
        draw.rectangle(
            [left, y + 4, left + max(length, 1), y + row - 6], fill=BAR_COLORS[i % len(BAR_COLORS)]
        )
        draw.text((left + length + 8, y + 8), f"{value:,.0f} {unit}", fill="black", font=font)
    image.save(path)
    return path


def charts_for(
    results: dict[str, Any], stem: str
) -> list[tuple[str, list[str], list[float], str, str]]:
    charts = []
    for key, title in (
        ("cifar", "CIFAR-100 train loader, CPU (img/s, higher is better)"),
        ("photo", "clothing-small 224 px RRC loader, CPU (img/s)"),
        ("conversion", "CIFAR-100 archive -> shards (img/s)"),
    ):
        rows = [r for r in results.get(key, []) if "img_per_s" in r]
        if rows:
            charts.append(
                (
                    title,
                    [r["method"] for r in rows],
                    [float(r["img_per_s"]) for r in rows],
                    "img/s",
                    f"{stem}-{key}.png",
                )
            )
    return charts


def main(args: argparse.Namespace) -> list[Path]:
    written = []
    for path in args.results:
        results = json.loads(path.read_text())
        out = args.out or path.parent
        out.mkdir(parents=True, exist_ok=True)
        for title, labels, values, unit, name in charts_for(results, path.stem):
            written.append(bar_chart(title, labels, values, unit, out / name))
            print(f"wrote {written[-1]}")
    return written


if __name__ == "__main__":
    main(parse_args())
