"""The installed distributions' files against their RECORDs: collisions and hash mismatches.

pip installs ``--no-deps`` wheels one over another without a word when two of them ship the
same path; the one installed last wins and the other's RECORD no longer describes what is
on disk. Two checks over a site-packages folder, from the RECORD files alone:

- ``collisions``: a path that two or more distributions list. Same content (the same
  sha256 in each RECORD, e.g. an empty namespace ``__init__.py``) is reported apart as
  ``shared``; different content is a collision.
- ``mismatches``: a RECORD entry with a hash whose file is missing or hashes differently.
  Byte-code under ``__pycache__`` is not compared: Python rewrites a stale ``.pyc`` on
  import (a wheel's own ``.pyc`` is stale once pip gives its ``.py`` a new mtime).
"""
from __future__ import annotations

import base64
import csv
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Entry:
    dist: str            # "name version"
    path: Path           # absolute, normalized
    sha256: str | None   # the RECORD's urlsafe-base64 digest, None when unhashed (RECORD itself, .pyc)


@dataclass
class Report:
    dists: int = 0
    files: int = 0
    hashed: int = 0
    collisions: dict[Path, list[Entry]] = field(default_factory=dict)
    shared: dict[Path, list[Entry]] = field(default_factory=dict)
    mismatches: list[tuple[Entry, str]] = field(default_factory=list)


def _dist_name(dist_info: Path) -> str:
    meta = dist_info / "METADATA"
    name = version = None
    if meta.is_file():
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Name:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("Version:"):
                version = line.split(":", 1)[1].strip()
            elif not line.strip():
                break
    return f"{name or dist_info.name.split('-')[0]} {version or '?'}"


def record_entries(dist_info: Path) -> list[Entry]:
    """A distribution's RECORD rows, paths resolved against the folder that holds dist_info."""
    record = dist_info / "RECORD"
    if not record.is_file():
        return []
    dist = _dist_name(dist_info)
    base = dist_info.parent
    out = []
    with record.open(newline="", encoding="utf-8", errors="replace") as handle:
        for row in csv.reader(handle):
            if not row or not row[0]:
                continue
            algo, _, digest = (row[1] if len(row) > 1 else "").partition("=")
            out.append(Entry(dist, Path(os.path.normpath(base / row[0])), digest if algo == "sha256" else None))
    return out


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            h.update(block)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def check_site(site: Path, verify_hashes: bool = True) -> Report:
    report = Report()
    claims: dict[Path, list[Entry]] = {}
    for dist_info in sorted(site.glob("*.dist-info")):
        entries = record_entries(dist_info)
        if not entries:
            continue
        report.dists += 1
        for entry in entries:
            claims.setdefault(entry.path, []).append(entry)
            report.files += 1
            if entry.sha256 is None or not verify_hashes or entry.path.suffix == ".pyc":
                continue
            report.hashed += 1
            if not entry.path.is_file():
                report.mismatches.append((entry, "missing"))
            elif file_digest(entry.path) != entry.sha256:
                report.mismatches.append((entry, "hash differs from RECORD"))
    for path, entries in claims.items():
        if len({e.dist for e in entries}) < 2:
            continue
        digests = {e.sha256 for e in entries}
        target = report.shared if len(digests) == 1 and None not in digests else report.collisions
        target[path] = entries
    return report


def describe(report: Report, site: Path, limit: int = 3) -> tuple[bool, str]:
    """(ok, one line) for the self-test."""
    def rel(path: Path) -> str:
        try:
            return str(path.relative_to(site))
        except ValueError:
            return str(path)

    problems = []
    if report.collisions:
        shown = [f"{rel(p)} ({' vs '.join(e.dist for e in entries)})"
                 for p, entries in sorted(report.collisions.items())[:limit]]
        problems.append(f"{len(report.collisions)} path(s) claimed by two distributions with different content: "
                        + "; ".join(shown))
    if report.mismatches:
        shown = [f"{rel(e.path)} of {e.dist}: {why}" for e, why in report.mismatches[:limit]]
        problems.append(f"{len(report.mismatches)} RECORD mismatch(es): " + "; ".join(shown))
    if problems:
        return False, "; ".join(problems)
    shared = f", {len(report.shared)} identical file(s) shipped by more than one" if report.shared else ""
    return True, (f"{report.dists} distributions, {report.files} RECORD entries, {report.hashed} hashes match, "
                  f"no path claimed twice{shared}")
