"""Read the hash-locked requirement files (build/lock/*.txt) and sha256sum lists."""
from __future__ import annotations

import re

_REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def entries_from_lock(text: str) -> dict[str, tuple[str, str]]:
    """normalized name -> (version, sha256)."""
    out: dict[str, tuple[str, str]] = {}
    current: tuple[str, str] | None = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip().rstrip("\\").strip()
        if not line:
            continue
        match = _REQ.match(line)
        if match:
            current = (_normalize(match.group(1)), match.group(2))
            rest = line[match.end():]
        else:
            rest = line
        hashed = re.search(r"--hash=sha256:([0-9a-f]{64})", rest)
        if hashed and current:
            out[current[0]] = (current[1], hashed.group(1))
    return out


def hashes_from_lock(text: str) -> dict[str, str]:
    return {name: sha for name, (_, sha) in entries_from_lock(text).items()}


def wheel_sums(text: str) -> dict[str, str]:
    """``sha256sum`` output -> {wheel file name: sha256}."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and re.fullmatch(r"[0-9a-f]{64}", parts[0]):
            out[parts[1].lstrip("*").removeprefix("./")] = parts[0]
    return out


def project_of_wheel(filename: str) -> str:
    return _normalize(filename.split("-", 1)[0])
