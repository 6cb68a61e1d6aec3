"""Write side: source -> encoded samples -> deterministic tar shards + DALI index -> manifest."""

from fastdata.write.encode import DEFAULT_MAX_PIXELS, ENCODINGS, BadSampleError
from fastdata.write.errors import TooManyBadSamplesError
from fastdata.write.lock import FolderLockedError
from fastdata.write.parts import MergeError, Part, merge_parts, write_part
from fastdata.write.writer import ShardingError, ShardOptions, write_shards

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "ENCODINGS",
    "BadSampleError",
    "FolderLockedError",
    "MergeError",
    "Part",
    "ShardOptions",
    "ShardingError",
    "TooManyBadSamplesError",
    "merge_parts",
    "write_part",
    "write_shards",
]
