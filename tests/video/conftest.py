"""Video fixtures: small clips made with PyAV (`tests/video/clips.py`) and their shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.video.clips import Clip, make_tree, make_video, truncate

pytest.importorskip("av")

#: The zoo: one of each kind of file users have, in two classes (the square's direction).
ZOO: dict[str, list[tuple[str, Clip]]] = {
    "left": [
        ("h264.mp4", Clip(direction=-1)),
        ("vp9_odd.webm", Clip(codec="libvpx-vp9", width=33, height=47, direction=-1)),
        ("vfr.mp4", Clip(vfr=True, direction=-1, frames=20)),
    ],
    "right": [
        ("audio.mp4", Clip(audio=True, frames=32)),
        ("rotated.mp4", Clip(rotation=90, frames=16)),
        ("long.mp4", Clip(frames=64, gop=16)),
    ],
}


@pytest.fixture
def video_tree(tmp_path: Path) -> Path:
    """The zoo as class folders, plus a truncated file in "right"."""
    root = make_tree(tmp_path / "videos", ZOO)
    truncate(make_video(root / "right" / "broken.mp4", Clip(frames=24)))
    return root
