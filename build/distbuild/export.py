"""Regenerate ``patches/<upstream>/`` from the commits on top of the pristine tree.

How developers author patches: edit ``work/src/<upstream>``, commit, export.
The output is deterministic (zero commit ids, full blob ids, no signature, a
fixed Date), so exporting an unchanged tree rewrites nothing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from email.utils import format_datetime
from datetime import datetime
from pathlib import Path
from typing import Callable

from .errors import DistBuildError
from .gitrepo import FIXED_DATE, PREPARED_REF, PRISTINE_REF, Repo, git_env
from .identity import Identity, header_identity, sign_off_as
from .generated import generated_file_problems
from .series import check_headers, parse_patch, series_entries

FORMAT_PATCH = ("format-patch", "-1", "--stdout", "--zero-commit", "--no-signature", "--full-index",
                "--no-renames", "--no-numbered", "--encode-email-headers")
FIXED_DATE_HEADER = "Date: " + format_datetime(datetime.fromisoformat(FIXED_DATE))


@dataclass
class ExportResult:
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def slug(subject: str) -> str:
    text = re.sub(r"[^A-Za-z0-9]+", "-", subject).strip("-")
    return text[:60].rstrip("-") or "patch"


def render(repo: Repo, commit: str, identity: Identity | None = None) -> bytes:
    if identity is not None:
        commit = reauthored(repo, commit, identity)
    text = repo.git(*FORMAT_PATCH, commit).stdout.decode()
    text = re.sub(r"^Date: .*$", FIXED_DATE_HEADER, text, count=1, flags=re.M)
    return text.encode()


def reauthored(repo: Repo, commit: str, identity: Identity) -> str:
    """A commit object with ``commit``'s tree, parent and message, authored and
    signed off by ``identity`` alone; git itself then writes the From: header
    (its own encoding), so a re-export of the applied series is byte-identical."""
    message = sign_off_as(repo.git("log", "-1", "--format=%B", commit).stdout.decode(), identity)
    env = {**git_env(), "GIT_AUTHOR_NAME": identity.name, "GIT_AUTHOR_EMAIL": identity.email}
    tree, parent = repo.out("rev-parse", f"{commit}^{{tree}}"), repo.out("rev-parse", f"{commit}^")
    return repo.git("commit-tree", tree, "-p", parent, input=message.encode(), env=env).stdout.decode().strip()


def series_identity(directory: Path) -> Identity | None:
    """The one author the exported series already carries, if it has one."""
    series_file = directory / "series"
    if not series_file.is_file():
        return None
    found = set()
    for entry in series_entries(series_file):
        path = directory / entry
        if path.is_file():
            found.add(header_identity(path.read_text(errors="replace").partition("\n---\n")[0]))
    return found.pop() if len(found) == 1 else None


def _subject_of(data: bytes, tmp: Path) -> str:
    tmp.write_bytes(data)
    try:
        return parse_patch(tmp).subject
    finally:
        tmp.unlink()


def export(upstream: str, tree: Path, directory: Path, log: Callable[[str], None] = print,
           identity: Identity | None = None) -> ExportResult:
    """Write one patch per commit. With ``identity`` every patch is authored
    and signed off by it alone (see identity.py); without, by the identity
    the series already has, or as committed when it has none."""
    repo = Repo(tree)
    if not repo.is_repo() or repo.ref(PRISTINE_REF) is None:
        raise DistBuildError(f"{tree}: not a prepared tree; run `make patched` first")
    dirty = repo.dirty()
    if dirty:
        raise DistBuildError(f"{tree}: uncommitted changes ({dirty[0].strip()} ...); commit them, then export")
    commits = repo.out("rev-list", "--reverse", f"{PRISTINE_REF}..HEAD").split()
    identity = identity or series_identity(directory)
    directory.mkdir(parents=True, exist_ok=True)
    series_file = directory / "series"
    old_entries = series_entries(series_file) if series_file.exists() else []
    by_subject = {}
    for entry in old_entries:
        if (directory / entry).is_file():
            by_subject[parse_patch(directory / entry).subject] = entry

    result = ExportResult()
    new_entries: list[str] = []
    scratch = directory / ".export-subject.tmp"
    for index, commit in enumerate(commits, start=1):
        data = render(repo, commit, identity)
        subject = _subject_of(data, scratch)
        name = by_subject.get(subject) or f"{index:04d}-{slug(subject)}.patch"
        if name in new_entries:
            raise DistBuildError(f"{tree}: two commits export to {name}; give them distinct subjects")
        new_entries.append(name)
        target = directory / name
        if target.is_file() and target.read_bytes() == data:
            result.unchanged.append(name)
        else:
            tmp = target.with_suffix(".patch.tmp")
            tmp.write_bytes(data)
            tmp.replace(target)
            result.written.append(name)
        result.warnings.extend(check_headers(parse_patch(target)))
        result.warnings.extend(generated_file_problems(target))
    for entry in old_entries:
        if entry not in new_entries:
            (directory / entry).unlink(missing_ok=True)
            result.removed.append(entry)
    if new_entries != old_entries or not series_file.exists():
        series_file.write_text(_rewrite_series(series_file, old_entries, new_entries))
    repo.set_ref(PREPARED_REF, repo.head())
    for name in result.written:
        log(f"wrote     patches/{upstream}/{name}")
    for name in result.removed:
        log(f"removed   patches/{upstream}/{name}")
    for warning in result.warnings:
        log(f"warning   {warning}")
    return result


def _rewrite_series(series_file: Path, old_entries: list[str], new_entries: list[str]) -> str:
    """New order of entries; each keeps the comment lines written just above it."""
    header: list[str] = []
    comments: dict[str, list[str]] = {}
    pending: list[str] = []
    if series_file.exists():
        for line in series_file.read_text().splitlines():
            entry = line.split("#", 1)[0].strip()
            if entry:
                comments[entry.split()[0]] = pending
                pending = []
            elif not comments and not pending and line.startswith("#"):
                header.append(line)
            else:
                pending.append(line)
    if not header:
        header = ["# Applied in this order by `make patched`; comments say why an order matters."]
    lines = header[:]
    for entry in new_entries:
        lines.extend(comments.get(entry, []))
        lines.append(entry)
    return "\n".join(lines) + "\n"
