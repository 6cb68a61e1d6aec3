"""A video file -> its shard components: the file as it is, and its clip index.

`probe_video` reads the index from the container (`fastdata.format.video.probe`: its packets
demuxed, no frame decoded for it but the first, which checks that the stream decodes and gives
its rotation). A video file is untrusted input: its byte size and frame size are bounded before
anything is decoded, and a file that cannot be opened, has no video stream, or ends before the
duration its header states (a truncated download) is a bad sample, skipped and listed like a
bad image (or fatal under ``--strict``).
"""

from __future__ import annotations

from fastdata.format.video import CLIP_INDEX_EXT, VIDEO_EXTS, ClipIndex, ClipIndexError, probe
from fastdata.write.encode import BadSampleError, EncodedSample, read_source_file
from fastdata.write.sources.base import SourceItem

__all__ = ["encode_video", "probe_video"]


def probe_video(data: bytes | memoryview, origin: str, max_pixels: int | None) -> ClipIndex:
    """The clip index of a video file's bytes (`fastdata.format.video.probe`).

    Raises:
        BadSampleError: naming `origin`: not a readable video, no video stream, frames over
            `max_pixels`, too many frames, a truncated file, or a first frame that does not
            decode.
    """
    try:
        return probe(data, max_pixels)
    except ClipIndexError as exc:
        raise BadSampleError(origin, str(exc)) from exc


def encode_video(
    item: SourceItem, max_bytes: int | None, max_pixels: int | None
) -> tuple[EncodedSample, dict[str, bytes]]:
    """A video item's stored component (its file, as it is) and its clip index component.

    Returns:
        (the video component as an `EncodedSample`: ext "mp4" or "webm", the file's bytes, the
        displayed height and width; {"vidx": the clip index's JSON}).

    Raises:
        BadSampleError: see `probe_video`; also a file over `max_bytes`, or in a container that
            is not MP4/MOV or WebM/Matroska.
    """
    if item.data is not None:
        data = item.data
    elif item.path is not None:
        data = read_source_file(item, max_bytes, f"over max_video_bytes={max_bytes:,}")
    else:
        raise BadSampleError(item.origin, "the source gives no video here (no bytes or file)")
    if max_bytes is not None and len(data) > max_bytes:
        raise BadSampleError(item.origin, f"video is {len(data):,} bytes, over {max_bytes:,}")
    ext = _container_ext(data, item.origin)
    index = probe_video(data, item.origin, max_pixels)
    height, width = index.display_hw
    return EncodedSample(ext, data, height, width), {CLIP_INDEX_EXT: index.to_json()}


def _container_ext(data: bytes, origin: str) -> str:
    """ "mp4" (ISO base media: MP4, MOV, M4V) or "webm" (EBML: WebM, Matroska) from the magic."""
    if data[4:8] == b"ftyp" or data[4:8] in (b"moov", b"mdat", b"wide", b"free"):
        return VIDEO_EXTS[0]
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return VIDEO_EXTS[1]
    raise BadSampleError(
        origin, "not an MP4/MOV or WebM/Matroska file (other containers: remux with ffmpeg -c copy)"
    )
