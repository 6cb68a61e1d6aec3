"""Which PIL fastdata runs on: Pillow or Pillow-SIMD, whichever the environment has.

Both distributions install the same `PIL` package, and pip treats them as unrelated: a requirement
on one writes its files over the other's. So fastdata names neither as a dependency (pyproject's
extras `fastdata[pillow]` / `fastdata[simd]` install one where there is none) and reports here
which one it found, for the benchmarks' JSON and for a user checking a speed-up. Standard library
only, and PIL imported only when asked: `import fastdata` checks that PIL exists through `require`.
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import asdict, dataclass

__all__ = ["MISSING", "PilInfo", "pil_info", "require"]

#: The ImportError's message where no distribution provides PIL.
MISSING = (
    "fastdata needs PIL (Pillow >= 9 or Pillow-SIMD), and this environment has neither. "
    "Install one: `pip install 'fastdata[pillow]'` (or `pip install pillow`), or for Pillow-SIMD's "
    "faster resize and colour conversion `pip install 'fastdata[simd]'` (builds from source: needs "
    "a C compiler and the libjpeg/zlib headers)."
)

#: Distributions known to install the `PIL` package (normalized names).
_PIL_DISTRIBUTIONS = ("pillow", "pillow-simd")


@dataclass(frozen=True)
class PilInfo:
    """The PIL fastdata imports, and the distributions that installed it.

    Attributes:
        version: `PIL.__version__` (Pillow-SIMD's read like "12.1.1.post0").
        distribution: the installed distribution whose files `PIL` is ("pillow" or "pillow-simd"),
            or "unknown" where no installed metadata claims it (a vendored or system copy).
        distributions: every installed distribution claiming `PIL` (normalized names, sorted).
            More than one means their files are mixed in one folder: see `problem`.
        simd: True for Pillow-SIMD (its resize and colour-conversion kernels use SSE4/AVX2).
        libjpeg_turbo: the libjpeg-turbo version PIL decodes JPEG with, or None where it was
            built with another libjpeg (or cannot say).
        location: the folder `PIL` is imported from.
        problem: what is wrong and how to fix it, or None when exactly one distribution claims PIL.
    """

    version: str
    distribution: str
    distributions: tuple[str, ...]
    simd: bool
    libjpeg_turbo: str | None
    location: str
    problem: str | None

    def describe(self) -> str:
        """One line for a log or a CLI: e.g. "Pillow-SIMD 12.1.1.post0 (libjpeg-turbo 2.1.5)"."""
        name = {"pillow": "Pillow", "pillow-simd": "Pillow-SIMD"}.get(
            self.distribution, f"PIL ({self.distribution} distribution)"
        )
        jpeg = f"libjpeg-turbo {self.libjpeg_turbo}" if self.libjpeg_turbo else "no libjpeg-turbo"
        line = f"{name} {self.version} ({jpeg})"
        return f"{line}; {self.problem}" if self.problem else line

    def as_dict(self) -> dict[str, object]:
        """The fields as JSON-ready values (a benchmark's environment record)."""
        record = asdict(self)
        record["distributions"] = list(self.distributions)
        return record


def require() -> None:
    """Raise an ImportError that says what to install where no distribution provides PIL.

    Raises:
        ImportError: `MISSING`, chained to the failed import.
    """
    try:
        import PIL  # noqa: F401  (the package's __init__ only: cheap)
    except ImportError as exc:
        raise ImportError(MISSING) from exc


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _claiming_distributions() -> tuple[str, ...]:
    """Installed distributions with `PIL` among their top-level packages."""
    claims = md.packages_distributions().get("PIL", [])
    return tuple(sorted({_normalize(name) for name in claims}))


def _libjpeg_turbo_version() -> str | None:
    from PIL import features

    try:
        if not features.check_feature("libjpeg_turbo"):
            return None
        return features.version_feature("libjpeg_turbo")
    except ValueError:  # a PIL too old to know the feature
        return None


def pil_info() -> PilInfo:
    """Which PIL this environment imports: distribution, version, libjpeg-turbo, and any clash.

    Returns:
        A `PilInfo`. Its `problem` is set when two distributions' files are mixed in one `PIL`
        folder (e.g. `pip install pillow-simd` over Pillow): one then breaks when the other is
        uninstalled, and `version` is whichever wrote `PIL/__init__.py` last.

    Raises:
        ImportError: no PIL is installed (the message says what to install).
    """
    require()
    import PIL

    claims = _claiming_distributions()
    known = [name for name in claims if name in _PIL_DISTRIBUTIONS]
    if len(claims) == 1:
        distribution = claims[0]
    elif "post" in PIL.__version__ and "pillow-simd" in claims:
        distribution = "pillow-simd"  # Pillow-SIMD's versions are Pillow's plus ".postN"
    elif known:
        distribution = known[0]
    else:
        distribution = "unknown"
    problem = None
    if len(claims) > 1:
        problem = (
            f"PIL's files come from {len(claims)} distributions ({', '.join(claims)}) written over "
            "each other; uninstalling one breaks PIL for every package. Keep one: "
            f"`pip uninstall -y {' '.join(claims)}`, then `pip install pillow` (or Pillow-SIMD: "
            "see fastdata's README, Set-up)"
        )
    return PilInfo(
        version=PIL.__version__,
        distribution=distribution,
        distributions=claims,
        simd=distribution == "pillow-simd",
        libjpeg_turbo=_libjpeg_turbo_version(),
        location=str(PIL.__path__[0]),
        problem=problem,
    )
