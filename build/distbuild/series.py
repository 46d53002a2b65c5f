"""Read and check ``patches/<upstream>/series`` and the patches' DEP-3 headers.

The series file lists one patch file per line in application order; ``#``
starts a comment (comments say why an order matters). Every listed file must
exist, and every ``*.patch`` in the folder must be listed.
"""
from __future__ import annotations

import email.header
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import DistBuildError

DEP3_FIELDS = ("Origin", "Forwarded", "Bug", "Last-Update", "Applied-Upstream")


@dataclass(frozen=True)
class Patch:
    path: Path
    subject: str
    fields: dict[str, str]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    @property
    def forwarded(self) -> str | None:
        return self.fields.get("Forwarded")


def series_entries(series_file: Path) -> list[str]:
    entries: list[str] = []
    for line in series_file.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            entries.append(entry.split()[0])
    return entries


def load_series(directory: Path) -> list[Patch]:
    """The patches of one upstream in order; an absent folder is an empty series."""
    series_file = directory / "series"
    if not directory.exists():
        return []
    if not series_file.is_file():
        raise DistBuildError(f"{directory}: has no series file")
    entries = series_entries(series_file)
    seen: set[str] = set()
    for entry in entries:
        if entry in seen:
            raise DistBuildError(f"{series_file}: {entry} is listed twice")
        seen.add(entry)
        if not (directory / entry).is_file():
            raise DistBuildError(f"{series_file}: lists {entry}, which does not exist")
    unlisted = sorted(p.name for p in directory.glob("*.patch") if p.name not in seen)
    if unlisted:
        raise DistBuildError(f"{series_file}: {', '.join(unlisted)} not listed in the series")
    return [parse_patch(directory / entry) for entry in entries]


def parse_patch(path: Path) -> Patch:
    text = path.read_text(errors="replace")
    header, _, _ = text.partition("\n---\n")
    subject = _subject(header)
    if subject is None:
        raise DistBuildError(f"{path}: not a git format-patch file (no Subject: header)")
    fields: dict[str, str] = {}
    for line in header.splitlines():
        match = re.match(r"^([A-Za-z-]+):\s*(.*)$", line)
        if match and match.group(1) in (*DEP3_FIELDS, "Signed-off-by"):
            fields.setdefault(match.group(1), match.group(2).strip())
    return Patch(path=path, subject=subject, fields=fields)


def _subject(header: str) -> str | None:
    lines = header.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Subject:"):
            value = line[len("Subject:"):]
            for cont in lines[i + 1:]:
                if cont.startswith((" ", "\t")):
                    value += cont
                else:
                    break
            decoded = "".join(
                part.decode(enc or "utf-8") if isinstance(part, bytes) else part
                for part, enc in email.header.decode_header(value.strip())
            )
            return re.sub(r"^\[PATCH[^\]]*\]\s*", "", decoded).strip()
    return None


def check_headers(patch: Patch) -> list[str]:
    """Convention problems of one patch (empty when it is fine)."""
    problems = []
    if "Signed-off-by" not in patch.fields:
        problems.append(f"{patch.path}: no Signed-off-by (the upstreams require DCO)")
    if "Forwarded" not in patch.fields:
        problems.append(f"{patch.path}: no DEP-3 Forwarded: field")
    bug = patch.fields.get("Bug")
    if bug is not None and not re.match(r"^https?://\S+$", bug):
        problems.append(f"{patch.path}: DEP-3 Bug: must be the URL of an upstream report, not {bug[:60]!r} "
                        "(say the rest in the description)")
    return problems
