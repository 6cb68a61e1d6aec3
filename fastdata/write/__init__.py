"""Write side: source -> encoded samples -> deterministic tar shards + DALI index -> manifest."""

from fastdata.write.encode import ENCODINGS, BadSampleError
from fastdata.write.parts import MergeError, Part, merge_parts, write_part
from fastdata.write.writer import ShardingError, ShardOptions, write_shards

__all__ = [
    "ENCODINGS",
    "BadSampleError",
    "MergeError",
    "Part",
    "ShardOptions",
    "ShardingError",
    "merge_parts",
    "write_part",
    "write_shards",
]
