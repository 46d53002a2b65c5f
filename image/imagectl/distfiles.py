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


# Found in the image and reviewed; each entry names the exact path and distributions.
# A path claimed twice: site-relative path -> (the distributions, why it is harmless).
ACCEPTED_COLLISIONS: dict[str, tuple[frozenset[str], str]] = {
    "build_backend.py": (frozenset({"flashinfer-python", "torch_c_dlpack_ext"}),
                         "both wheels ship their in-tree PEP 517 build backend as a top-level module; "
                         "nothing imports it at run time"),
}
# A RECORD hash that does not match: (distribution, site-relative path) -> why.
ACCEPTED_MISMATCHES: dict[tuple[str, str], str] = {
    ("pynvvideocodec", "PyNvVideoCodec/PyNvVideoCodec_121.cpython-311-x86_64-linux-gnu.so"):
        "pynvvideocodec 2.0.4's own wheel has this hash wrong in its RECORD (checked against the wheel)",
    ("pynvvideocodec", "PyNvVideoCodec/PyNvVideoCodec_130.cpython-311-x86_64-linux-gnu.so"):
        "pynvvideocodec 2.0.4's own wheel has this hash wrong in its RECORD (checked against the wheel)",
    ("torch_c_dlpack_ext", "build_backend.py"):
        "overwritten by flashinfer-python's build_backend.py (see ACCEPTED_COLLISIONS)",
}


def _source_of(rel_path: str) -> str:
    """__pycache__/mod.cpython-311.pyc -> mod.py (a module's bytecode goes with its source)."""
    path = Path(rel_path)
    if path.parent.name == "__pycache__" and path.suffix == ".pyc":
        return str(path.parent.parent / (path.name.split(".", 1)[0] + ".py"))
    return rel_path


def _dist_only(dist: str) -> str:
    return dist.rsplit(" ", 1)[0].lower().replace("-", "_") if " " in dist else dist.lower()


def accepted(report: Report, site: Path) -> tuple[Report, list[str]]:
    """The report without the reviewed entries above, and one note per entry accepted."""
    def rel(path: Path) -> str:
        try:
            return str(path.relative_to(site))
        except ValueError:
            return str(path)

    kept = Report(report.dists, report.files, report.hashed, {}, dict(report.shared), [])
    notes: set[str] = set()
    for path, entries in report.collisions.items():
        rule = ACCEPTED_COLLISIONS.get(_source_of(rel(path)))
        dists = frozenset(_dist_only(e.dist).replace("_", "-") for e in entries)
        if rule and dists == frozenset(d.replace("_", "-") for d in rule[0]):
            notes.add(f"{_source_of(rel(path))}: {rule[1]}")
        else:
            kept.collisions[path] = entries
    for entry, why in report.mismatches:
        rule = ACCEPTED_MISMATCHES.get((_dist_only(entry.dist), rel(entry.path)))
        if rule and why != "missing":
            notes.add(f"{rel(entry.path)} of {entry.dist}: {rule}")
        else:
            kept.mismatches.append((entry, why))
    return kept, sorted(notes)


def describe(report: Report, site: Path, limit: int = 3) -> tuple[bool, str]:
    """(ok, one line) for the self-test."""
    def rel(path: Path) -> str:
        try:
            return str(path.relative_to(site))
        except ValueError:
            return str(path)

    report, notes = accepted(report, site)
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
    reviewed = f"; {len(notes)} reviewed exception(s): " + "; ".join(notes) if notes else ""
    return True, (f"{report.dists} distributions, {report.files} RECORD entries, {report.hashed} hashes match, "
                  f"no path claimed twice{shared}{reviewed}")
