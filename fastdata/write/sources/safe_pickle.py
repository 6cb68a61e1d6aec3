"""Loading the CIFAR pickles without letting a crafted file run code.

`pickle.load` imports and calls whatever the file names, so a file from the internet (or a "CIFAR
archive" from anywhere) could run `os.system`. The official CIFAR pickles only ever need numpy's
array reconstruction, so the unpickler here resolves exactly those globals and refuses the rest
before anything is called.
"""

from __future__ import annotations

import pickle
from typing import IO, Any

import numpy as np

from fastdata.write.sources.base import BadSourceError

__all__ = ["ALLOWED_GLOBALS", "UnsafePickleError", "safe_load"]

try:  # numpy >= 2 moved the implementation; importing numpy.core there warns.
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]


class UnsafePickleError(BadSourceError):
    """A pickle names a global outside `ALLOWED_GLOBALS` (it could run arbitrary code)."""


# (module, name) -> object. The official files were written by numpy 1.x under Python 2
# (`numpy.core.multiarray._reconstruct`); numpy 2 writes `numpy._core.multiarray`.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only `ALLOWED_GLOBALS`."""

    def __init__(self, fileobj: IO[bytes], *, encoding: str, name: str) -> None:
        super().__init__(fileobj, encoding=encoding)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            allowed = ", ".join(f"{m}.{n}" for m, n in ALLOWED_GLOBALS)
            raise UnsafePickleError(
                f"{self._name}: refusing to load {module}.{name} from this pickle: only numpy "
                f"arrays are expected ({allowed}). The file is not an official CIFAR pickle; "
                "get the archive from its official source."
            ) from None


def safe_load(fileobj: IO[bytes], *, encoding: str = "latin1", name: str | None = None) -> Any:
    """Unpickle `fileobj`, allowing only numpy array globals.

    Args:
        fileobj: a binary file object positioned at the start of a pickle.
        encoding: how Python-2 `str` objects are decoded; "latin1" keeps numpy array bytes intact
            (the CIFAR pickles were written by Python 2).
        name: how to call the file in messages (default: `fileobj.name`).

    Returns:
        The unpickled object (for CIFAR: a dict of arrays, lists and strings).

    Raises:
        UnsafePickleError: the pickle names any other global; nothing of it was run.
        BadSourceError: the file is not a readable pickle (truncated, corrupt).
    """
    label = name if name is not None else str(getattr(fileobj, "name", fileobj))
    try:
        return _RestrictedUnpickler(fileobj, encoding=encoding, name=label).load()
    except BadSourceError:  # the file under it is damaged: its own message says which
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise BadSourceError(
            f"{label}: not a readable pickle ({type(exc).__name__}: {exc}); the file may be "
            "truncated or corrupt: download it again."
        ) from exc
