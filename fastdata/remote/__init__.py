"""Remote datasets: shards on object storage or a web server, read through a node-local cache.

Needs `pip install "fastdata[remote]"` (fsspec with s3fs, gcsfs and aiohttp); `import fastdata`
works without it, and the first remote URL used says what to install.
"""

from fastdata.remote.cache import CachedShard, CacheStats, ShardCache
from fastdata.remote.config import (
    CACHE_DIR_ENV,
    CACHE_LIMIT_ENV,
    DEFAULT_LIMIT,
    DEFAULT_TIMEOUTS,
    TIMEOUT_ENVS,
    Timeouts,
    default_cache_dir,
    parse_size,
)
from fastdata.remote.fs import is_remote
from fastdata.remote.locks import LockTimeout
from fastdata.remote.retry import RemoteError, RetryPolicy

__all__ = [
    "CACHE_DIR_ENV",
    "CACHE_LIMIT_ENV",
    "DEFAULT_LIMIT",
    "DEFAULT_TIMEOUTS",
    "TIMEOUT_ENVS",
    "CacheStats",
    "CachedShard",
    "LockTimeout",
    "RemoteError",
    "RetryPolicy",
    "ShardCache",
    "Timeouts",
    "default_cache_dir",
    "is_remote",
    "parse_size",
]
