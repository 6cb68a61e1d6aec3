"""safe_load: numpy arrays load, anything that could run code is refused before it runs."""

from __future__ import annotations

import builtins
import io
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from fastdata.write.sources.base import BadSourceError
from fastdata.write.sources.safe_pickle import UnsafePickleError, safe_load


class _Reduce:
    """Pickles as a call of `func(*args)`: what a crafted file would contain."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def _attacks(marker: Path) -> dict[str, object]:
    return {
        "os.system": _Reduce(os.system, f"touch {marker}"),
        "builtins.eval": _Reduce(builtins.eval, f"open({str(marker)!r}, 'w').write('x')"),
        # Allowed globals first, then the attack: refusing must not depend on position.
        "hidden in a batch": {
            "data": np.zeros((2, 3), np.uint8),
            "x": _Reduce(os.system, f"touch {marker}"),
        },
    }


# The batch holds an array, whose bytes protocols 0-2 and 5 pickle through other globals
# (_codecs.encode, _frombuffer) that are refused first; 3 and 4 reach the attack itself.
_CASES = [
    *((attack, p) for attack in ("os.system", "builtins.eval") for p in range(6)),
    ("hidden in a batch", 3),
    ("hidden in a batch", 4),
]


@pytest.mark.parametrize(("attack", "protocol"), _CASES)
def test_malicious_pickle_is_refused_and_not_run(
    tmp_path: Path, attack: str, protocol: int
) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps(_attacks(marker)[attack], protocol=protocol)
    with pytest.raises(UnsafePickleError) as info:
        safe_load(io.BytesIO(data), name="evil.pkl")
    assert not marker.exists()
    message = str(info.value)
    assert "evil.pkl" in message
    # The refused global is named with its module: posix.system on Linux, builtins.eval (or
    # __builtin__.eval in a protocol-0 file).
    assert any(
        m in message for m in ("posix.system", "nt.system", "builtin__.eval", "builtins.eval")
    )


def test_unsafe_pickle_error_is_a_bad_source_error() -> None:
    assert issubclass(UnsafePickleError, BadSourceError)


@pytest.mark.parametrize("encoding", ["latin1", "bytes"])
@pytest.mark.parametrize("legacy", [False, True], ids=["numpy._core", "numpy.core"])
def test_official_format_loads(encoding: str, legacy: bool) -> None:
    rows = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    batch = {"data": rows, "fine_labels": [3, 7], "batch_label": "training batch 1 of 1"}
    data = pickle.dumps(batch, protocol=3)
    if legacy:  # numpy 1.x (and the real CIFAR files) spell the module numpy.core.multiarray
        data = data.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
        assert b"numpy.core.multiarray" in data
    loaded = safe_load(io.BytesIO(data), encoding=encoding)
    keys = {k.decode() if isinstance(k, bytes) else k: v for k, v in loaded.items()}
    np.testing.assert_array_equal(keys["data"], rows)
    assert keys["fine_labels"] == [3, 7]


def test_other_numpy_globals_are_refused() -> None:
    # Protocol 5 uses numpy's _frombuffer: harmless, but not part of the format, so refused.
    data = pickle.dumps(np.zeros(4, np.uint8), protocol=5)
    with pytest.raises(UnsafePickleError, match="_frombuffer"):
        safe_load(io.BytesIO(data), name="p5.pkl")


def test_truncated_pickle_is_a_clear_error() -> None:
    data = pickle.dumps({"data": np.zeros((2, 3072), np.uint8)}, protocol=3)
    with pytest.raises(BadSourceError, match="cut.pkl: not a readable pickle") as info:
        safe_load(io.BytesIO(data[: len(data) // 2]), name="cut.pkl")
    assert not isinstance(info.value, UnsafePickleError)
