"""Write side: source -> encoded samples -> deterministic tar shards + DALI index -> manifest."""

from fastdata.write.encode import ENCODINGS, BadSampleError
from fastdata.write.writer import ShardingError, ShardOptions, write_shards

__all__ = ["ENCODINGS", "BadSampleError", "ShardOptions", "ShardingError", "write_shards"]
