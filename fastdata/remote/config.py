"""Where the shard cache lives and how big it may grow (a size in the one grammar of
`fastdata._util.sizes.parse_size`, re-exported here: "50GB", "512MiB")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fastdata._util.sizes import parse_size

__all__ = [
    "CACHE_DIR_ENV",
    "CACHE_LIMIT_ENV",
    "DEFAULT_LIMIT",
    "DEFAULT_TIMEOUTS",
    "TIMEOUT_ENVS",
    "Timeouts",
    "default_cache_dir",
    "parse_size",
]

CACHE_DIR_ENV = "FASTDATA_CACHE_DIR"
CACHE_LIMIT_ENV = "FASTDATA_CACHE_LIMIT"
DEFAULT_LIMIT = "50GB"
#: Environment variables that override `Timeouts`' defaults (seconds), e.g. for a DataModule.
TIMEOUT_ENVS = {
    "connect": "FASTDATA_CONNECT_TIMEOUT",
    "read": "FASTDATA_READ_TIMEOUT",
    "lock": "FASTDATA_LOCK_TIMEOUT",
}


def default_cache_dir() -> Path:
    """`$FASTDATA_CACHE_DIR`, else `~/.cache/fastdata/shards`."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fastdata" / "shards"


@dataclass(frozen=True)
class Timeouts:
    """How long one remote request, and a wait on another process of the node, may take.

    Args:
        connect: seconds to open a connection to the store.
        read: seconds without a byte from an open connection (per read, so a slow but moving
            download of a big shard is not cut); a server that accepts and never answers fails
            after this, and the retry policy decides whether to try again.
        lock: seconds a reader waits on a cache lock held by another process of the node while
            the holder makes no progress (its download does not grow), before it raises.
    """

    connect: float = 10.0
    read: float = 30.0
    lock: float = 120.0

    def __post_init__(self) -> None:
        if min(self.connect, self.read, self.lock) <= 0:
            raise ValueError(f"Timeouts must be positive, got {self}")

    @classmethod
    def from_env(cls) -> Timeouts:
        """The defaults, each overridden by its variable in `TIMEOUT_ENVS` when set.

        Raises:
            ValueError: a variable is not a positive number of seconds (names it).
        """
        values: dict[str, float] = {}
        for name, env in TIMEOUT_ENVS.items():
            if text := os.environ.get(env):
                try:
                    values[name] = float(text)
                except ValueError:
                    raise ValueError(f"${env}={text!r} is not a number of seconds") from None
        return cls(**values)


DEFAULT_TIMEOUTS = Timeouts()
