"""The optional C extensions, or None where they were not built (no C compiler at install).

Every caller has a numpy or torch path for None: the extensions only make loops faster.
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["pixels"]


def _load_pixels() -> ModuleType | None:
    try:
        import fastdata._pixels as _pixels  # the module itself, not the package root's API
    except ImportError:
        return None
    return _pixels


#: `fastdata._pixels` (see fastdata/_pixels.c), or None.
pixels: ModuleType | None = _load_pixels()
