"""Requirements a pip resolution misses because pip evaluated markers on another Python.

pip evaluates environment markers with the interpreter it runs in; ``--python-version``
changes wheel tags, not markers. A lock made on CPython 3.11.7 therefore leaves out what
the image's CPython 3.11.2 needs (redis requires async-timeout on
``python_full_version < "3.11.3"``). Given pip's ``--report`` items, this re-evaluates each
installed distribution's ``Requires-Dist`` markers for the image's interpreter and returns
the requirements that are active there but absent from the closure.

Markers are parsed with the ``packaging`` that pip vendors (pip runs the lock, so it is
there). Extras: base requirements plus the extras the top-level request named; an extra
pulled in by a dependency is not recorded in pip's report and is not re-checked.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import DistBuildError
from ..pins import normalize_name


@dataclass(frozen=True)
class MissedRequirement:
    requirement: str   # name and specifier, no marker: what to add to the resolution
    needed_by: str
    marker: str

    def describe(self) -> str:
        return f"{self.requirement} (for {self.needed_by}: {self.marker})"


def marker_environment(python_full_version: str) -> dict[str, str]:
    parts = python_full_version.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise DistBuildError(f"image Python version {python_full_version!r}: expected MAJOR.MINOR.MICRO")
    return {"python_full_version": python_full_version, "python_version": ".".join(parts[:2]),
            "implementation_version": python_full_version, "platform_python_implementation": "CPython",
            "implementation_name": "cpython", "sys_platform": "linux", "os_name": "posix",
            "platform_system": "Linux", "platform_machine": "x86_64"}


def _packaging():
    try:
        from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    except ImportError as exc:  # pragma: no cover - pip is what runs the lock
        raise DistBuildError(f"make lock needs pip's vendored packaging to read markers: {exc}") from exc
    return Requirement, InvalidRequirement


def missed_requirements(install: list[dict], python_full_version: str) -> list[MissedRequirement]:
    """Requirements active on ``python_full_version`` that the resolved ``install`` lacks."""
    Requirement, InvalidRequirement = _packaging()
    env = marker_environment(python_full_version)
    present = {normalize_name(item["metadata"]["name"]) for item in install}
    missed: dict[str, MissedRequirement] = {}
    for item in install:
        meta = item["metadata"]
        extras = [""] + list(item.get("requested_extras") or [])
        for text in meta.get("requires_dist") or []:
            try:
                req = Requirement(text)
            except InvalidRequirement as exc:
                raise DistBuildError(f"{meta['name']} {meta['version']}: "
                                     f"unreadable Requires-Dist {text!r}: {exc}") from exc
            if req.marker is None:
                continue  # unconditional: pip already resolved it
            if not any(req.marker.evaluate({**env, "extra": extra}) for extra in extras):
                continue
            name = normalize_name(req.name)
            if name in present or name in missed:
                continue
            extras_part = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            missed[name] = MissedRequirement(f"{req.name}{extras_part}{req.specifier}", meta["name"], str(req.marker))
    return sorted(missed.values(), key=lambda m: m.requirement)
