"""The lock file: every upstream artifact the distribution consumes, by hash.

``build/pins.toml`` holds one ``[[artifact]]`` table per file: name, version,
kind (``sdist`` or ``wheel``), the exact file name, its sha256 and size, and a
role (``upstream`` for the source trees we patch, ``image`` for wheels the
image installs, ``toolchain`` for the builder's CUDA compiler). Source trees
also carry ``upstream``: the folder name under ``work/src`` and ``patches``.
No URL or host name is stored: files are found by name on the index pip uses.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import DistBuildError

ROLES = ("upstream", "image", "toolchain")
KINDS = ("sdist", "wheel")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_REQUIRED = ("name", "version", "kind", "role", "filename", "sha256", "size")

HEADER = """\
# Hash-locked upstream artifacts of the GLM-5.3 B300 distribution.
# Written by `python -m distbuild pin ...` (make pin): never edit by hand.
# Files are looked up by exact file name on the package index pip is
# configured to use; the sha256 is checked before a file is used.
"""


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    kind: str
    role: str
    filename: str
    sha256: str
    size: int
    upstream: str | None = None

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


def normalize_name(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pin_from_table(table: dict, where: str) -> Pin:
    missing = [key for key in _REQUIRED if key not in table]
    if missing:
        raise DistBuildError(f"{where}: missing field(s) {', '.join(missing)}")
    unknown = set(table) - set(_REQUIRED) - {"upstream"}
    if unknown:
        raise DistBuildError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    pin = Pin(**{key: table[key] for key in (*_REQUIRED, "upstream") if key in table})
    if pin.kind not in KINDS:
        raise DistBuildError(f"{where}: kind {pin.kind!r} is not one of {KINDS}")
    if pin.role not in ROLES:
        raise DistBuildError(f"{where}: role {pin.role!r} is not one of {ROLES}")
    if not _SHA256.match(pin.sha256):
        raise DistBuildError(f"{where}: sha256 {pin.sha256!r} is not 64 lowercase hex digits")
    if not isinstance(pin.size, int) or pin.size <= 0:
        raise DistBuildError(f"{where}: size {pin.size!r} is not a positive integer")
    if (pin.role == "upstream") != (pin.upstream is not None):
        raise DistBuildError(f"{where}: 'upstream' is required for role upstream and only there")
    if pin.role == "upstream" and pin.kind != "sdist":
        raise DistBuildError(f"{where}: an upstream source must be an sdist, not {pin.kind}")
    return pin


def load(path: Path) -> list[Pin]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise DistBuildError(f"{path}: lock file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise DistBuildError(f"{path}: not valid TOML: {exc}") from None
    tables = data.get("artifact", [])
    pins = [_pin_from_table(t, f"{path}: artifact #{i + 1} ({t.get('filename', '?')})") for i, t in enumerate(tables)]
    seen: set[str] = set()
    for pin in pins:
        if pin.filename in seen:
            raise DistBuildError(f"{path}: {pin.filename} is pinned twice")
        seen.add(pin.filename)
    return pins


def dumps(pins: list[Pin]) -> str:
    order = {role: i for i, role in enumerate(ROLES)}
    lines = [HEADER]
    for pin in sorted(pins, key=lambda p: (order[p.role], normalize_name(p.name), p.filename)):
        lines.append("[[artifact]]")
        for key, value in asdict(pin).items():
            if value is None:
                continue
            lines.append(f"{key} = {value}" if isinstance(value, int) else f'{key} = "{value}"')
        lines.append("")
    return "\n".join(lines)


def save(path: Path, pins: list[Pin]) -> None:
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(dumps(pins))
    tmp.replace(path)


def upstream_pin(pins: list[Pin], upstream: str) -> Pin:
    for pin in pins:
        if pin.upstream == upstream:
            return pin
    known = sorted(p.upstream for p in pins if p.upstream)
    raise DistBuildError(f"unknown upstream {upstream!r}: the lock file pins {', '.join(known)}")


def upstream_names(pins: list[Pin]) -> list[str]:
    return [p.upstream for p in pins if p.upstream]
