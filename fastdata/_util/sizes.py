"""Sizes written as text ("50GB", "512MiB", "1.5T"): the one grammar of the CLI, the library
and the environment variables (the rule, for users: docs/guides/data.md, "Sizes").

A number, then an optional unit, case ignored, spaces allowed between them:

- decimal (SI, as disk makers, `df -H`, litdata and Kubernetes count): `K`/`KB` = 10**3, `M`/`MB`
  = 10**6, `G`/`GB` = 10**9, `T`/`TB` = 10**12;
- binary (IEC): `Ki`/`KiB` = 2**10, `Mi`/`MiB` = 2**20, `Gi`/`GiB` = 2**30, `Ti`/`TiB` = 2**40;
- none, or `B`: bytes.

A bare `G` is decimal, as `GB` is: the letter alone never means something else than the letter
with `B` after it, and `i` is the one mark of a binary unit.
"""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = ["SIZE_EXAMPLES", "parse_size"]

#: What error messages suggest.
SIZE_EXAMPLES = "e.g. 500MB, 2G, 512MiB or a number of bytes"

_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?)(B?)\s*$", re.IGNORECASE)


def parse_size(size: str | int) -> int:
    """Bytes in a size: "50GB" and "50G" are 50 * 10**9, "512MiB" and "512Mi" 512 * 2**20,
    "1.5T" 1.5 * 10**12, "1000" and 1000 are 1000 bytes (a fraction of a byte is dropped).

    Raises:
        ValueError: the text is not a size, or the number is negative (the message quotes it).
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"not a size: {size!r} ({SIZE_EXAMPLES})")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"not a size: {size} (a size cannot be negative)")
        return size
    match = _SIZE.match(size)
    if match is None:
        raise ValueError(f"not a size: {size!r} ({SIZE_EXAMPLES})")
    number, unit, binary, _ = match.groups()
    if binary and not unit:  # "5i", "5iB"
        raise ValueError(f"not a size: {size!r} ({SIZE_EXAMPLES})")
    base = 1024 if binary else 1000
    return int(Decimal(number) * base ** _POWERS[unit.upper()])  # exact: no float rounding
