"""`fastdata.format.carve`: the val carve's ids, disjoint, seeded and nested; its checks.

How a carve reads on every backend and world size: tests/lightning/test_val_split.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastdata.format.carve import Carve, carve_ids


def test_carve_is_disjoint_seeded_and_nested():
    kept, carved = carve_ids(1000, 0.1, seed=0)
    assert len(carved) == 100 and len(kept) == 900
    assert not set(kept) & set(carved) and set(kept) | set(carved) == set(range(1000))
    again = carve_ids(1000, 0.1, seed=0)[1]
    assert np.array_equal(carved, again)  # stable
    assert not np.array_equal(carved, carve_ids(1000, 0.1, seed=1)[1])  # seeded
    assert set(carved) <= set(carve_ids(1000, 0.2, seed=0)[1])  # a prefix of one permutation
    for bad in (0, 1, 1.5, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match="val"):
            Carve(bad, 0)
