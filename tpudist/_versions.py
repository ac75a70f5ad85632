"""The torch and JAX releases tpudist is tested on, and the one warning a run outside them gets.

The suite runs in full on the pinned torch and JAX (CI's main job) and its torch tests on the other
torch releases below (CI's compatibility job, `scripts/test-compat VERSION`). A release outside these
may work; tpudist says once, at `tpudist.init()` and in `tpudist doctor`, that it was not tested, and
which releases were. Nothing here imports torch or jax: versions are read from the installed
packages' metadata, so the launcher (which imports neither) can ask too.
"""

from __future__ import annotations

import importlib.metadata
import warnings

__all__ = ["TESTED", "UntestedVersionWarning", "installed", "untested", "warn_untested"]

# package -> the releases the suite ran on (the minor is what is compared: 2.14.1 covers 2.14.x).
# Update together with .ci/run's compatibility job and the README's version table.
TESTED: dict[str, tuple[str, ...]] = {
    "torch": ("2.13.0", "2.14.1", "2.15.0"),
    "jax": ("0.10.2",),
    "jaxlib": ("0.10.2",),
}


class UntestedVersionWarning(UserWarning):
    """The running torch or JAX is a release tpudist's suite has not run on."""


def installed(package: str) -> str | None:
    """The installed release of `package` (e.g. "2.14.1+cu130"), or None where it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def untested() -> list[str]:
    """One line for each installed package whose release the suite has not run on, naming the
    tested ones, e.g. "torch 2.16.0 is not a tested release (tested: 2.13.0, 2.14.1, 2.15.0)"."""
    lines = []
    for package, tested in TESTED.items():
        version = installed(package)
        if version is not None and _minor(version) not in {_minor(t) for t in tested}:
            lines.append(f"{package} {version} is not a tested release (tested: {', '.join(tested)})")
    return lines


_warned = False


def warn_untested() -> None:
    """Warns once per process (UntestedVersionWarning) when torch or JAX is outside the tested
    releases; silent otherwise."""
    global _warned
    if _warned:
        return
    _warned = True
    lines = untested()
    if lines:
        warnings.warn("tpudist: " + "; ".join(lines) + ". It may work; if something breaks, pin a tested "
                      "release and report the failure with `tpudist doctor`'s output.",
                      UntestedVersionWarning, stacklevel=3)
