"""Retrying remote reads: which failures are transient, and exponential backoff with jitter.

Object stores and web servers fail now and then in ways that a second try fixes: a 503 or 429
from an overloaded front end, a connection reset, a body cut short. Those are retried with
exponential backoff and jitter (so that the ranks of a job do not retry in lockstep); a missing
object, a refused permission or a bad URL is not, and neither is anything after the last attempt:
then a `RemoteError` names the URL, the last failure and what to do.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "DEFAULT_RETRY",
    "IntegrityError",
    "RemoteError",
    "RetryPolicy",
    "is_transient",
    "retry_call",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Modules whose exceptions are network-level failures (a reset, a short body, a timeout).
_NETWORK_MODULES = ("aiohttp", "botocore", "aiobotocore", "urllib3", "requests", "http.client")
# HTTP statuses worth another try: timeouts, throttling and server-side failures.
_RETRY_STATUS = {408, 425, 429}


class RemoteError(RuntimeError):
    """A remote object could not be read or written. The message names the URL and what to do.

    Args:
        url: the object's URL.
        reason: what went wrong (with the last underlying error).
        hint: what the user can do about it.
    """

    def __init__(self, url: str, reason: str, hint: str) -> None:
        super().__init__(f"{url}: {reason}. {hint}")
        self.url, self.reason, self.hint = url, reason, hint

    def __reduce__(self):  # DataLoader workers pickle exceptions: keep every field
        return (type(self), (self.url, self.reason, self.hint))


class IntegrityError(IOError):
    """A downloaded object is not what the manifest says (size or sha256): retried, as transient."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a remote operation is tried.

    Args:
        attempts: tries in all (1 = no retry).
        base_delay: seconds before the second try; doubled for each further try.
        max_delay: the longest wait between two tries, in seconds.
    """

    attempts: int = 6
    base_delay: float = 0.5
    max_delay: float = 20.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay < 0 or self.max_delay < 0:
            raise ValueError(f"RetryPolicy needs attempts >= 1 and delays >= 0, got {self}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait after failed try number `attempt` (0-based): capped, half jittered."""
        cap = min(self.max_delay, self.base_delay * 2.0**attempt)
        return cap / 2 + rng.uniform(0, cap / 2)


DEFAULT_RETRY = RetryPolicy()


def _status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (aiohttp, botocore), if any."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code if isinstance(code, int) else None
    return None


def is_transient(exc: BaseException) -> bool:
    """True for failures that another try may fix (5xx, 429, reset, timeout, short or bad body)."""
    if isinstance(exc, IntegrityError):
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    for link in (exc, exc.__cause__, exc.__context__):
        if link is None:
            continue
        status = _status(link)
        if status is not None:
            return status >= 500 or status in _RETRY_STATUS
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
        return True
    return type(exc).__module__.startswith(_NETWORK_MODULES)


def retry_call(
    fn: Callable[[], T],
    url: str,
    action: str,
    policy: RetryPolicy,
    rng: random.Random | None = None,
) -> T:
    """Call `fn` until it succeeds, retrying transient failures with backoff.

    Args:
        fn: the operation (no arguments).
        url: the object it reads or writes, for the messages.
        action: what it does, e.g. "download", for the messages.
        policy: attempts and delays.
        rng: jitter source (tests pass a seeded one).

    Raises:
        FileNotFoundError, PermissionError: at once (another try would not help).
        RemoteError: after the last attempt, or for another non-transient failure.
    """
    rng = rng or random.Random()
    for attempt in range(policy.attempts):
        try:
            return fn()
        except (FileNotFoundError, PermissionError):
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if not is_transient(exc):
                raise RemoteError(
                    url, f"{action} failed ({reason})", "Check the URL and the credentials."
                ) from exc
            if attempt + 1 == policy.attempts:
                raise RemoteError(
                    url,
                    f"{action} failed {policy.attempts} times; last error {reason}",
                    "Check the network and the store's status, then run again; for a flaky "
                    "store pass a RetryPolicy with more attempts, or copy the dataset to local "
                    "disk and read it from there.",
                ) from exc
            wait = policy.delay(attempt, rng)
            log.info(
                "%s of %s failed (%s); try %d in %.2f s", action, url, reason, attempt + 2, wait
            )
            time.sleep(wait)
    raise AssertionError("unreachable: the loop returns or raises")
