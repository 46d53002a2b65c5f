"""Unpack a pinned sdist as the pristine commit and apply its series on top.

The new tree is built beside the old one and swapped in only when every patch
applied, so a failed patch leaves no half-patched tree. The pristine commit
and each patch commit use a fixed identity and clock (see ``gitrepo``), so
tree and commit hashes are the same on every machine and every run.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import DistBuildError
from .gitrepo import PREPARED_REF, PRISTINE_REF, Repo
from .pins import Pin
from .series import Patch


@dataclass(frozen=True)
class PreparedTree:
    upstream: str
    path: Path
    pristine_commit: str
    pristine_tree: str
    patched_commit: str
    patched_tree: str
    patches: list[Patch]
    changed: bool


class PatchConflict(DistBuildError):
    pass


def safe_extractall(archive: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path, where: str) -> None:
    """``extractall`` with the ``data`` filter; on a Python without it (3.11 before 3.11.4,
    e.g. Debian bookworm's 3.11.2, the image's builder) the same refusals by hand:
    absolute or ``..`` paths, links that leave the tree, devices and FIFOs; owner and
    mode bits reset the same way."""
    if hasattr(tarfile, "data_filter"):
        archive.extractall(dest, filter="data")
        return
    for member in members:
        parts = Path(member.name).parts
        if member.name.startswith("/") or ".." in parts:
            raise DistBuildError(f"{where}: member {member.name!r} leaves the extraction folder")
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise DistBuildError(f"{where}: member {member.name!r} is a device or FIFO")
        if member.issym() or member.islnk():
            base = Path(member.name).parent if member.issym() else Path()
            target = Path(member.linkname)
            if target.is_absolute() or ".." in (base / target).parts and not _stays_inside(base / target):
                raise DistBuildError(f"{where}: link {member.name!r} -> {member.linkname!r} leaves the tree")
    cleaned = []
    for member in members:   # as the data filter: owned by whoever extracts, no setuid/sticky/group-other write
        member = copy.copy(member)
        member.uid, member.gid, member.uname, member.gname = os.getuid(), os.getgid(), "", ""
        if member.mode is not None and not member.issym():
            member.mode &= 0o755 if member.isdir() or member.mode & 0o100 else 0o644
        cleaned.append(member)
    archive.extractall(dest, members=cleaned)


def _stays_inside(relative: Path) -> bool:
    depth = 0
    for part in relative.parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        if depth < 0:
            return False
    return True


def unpack_sdist(sdist: Path, dest: Path) -> None:
    """Extract ``sdist`` into ``dest`` without its single top-level folder."""
    if not sdist.name.endswith((".tar.gz", ".tgz")):
        raise DistBuildError(f"{sdist.name}: only .tar.gz sdists are supported")
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            members = archive.getmembers()
            tops = {m.name.split("/", 1)[0] for m in members}
            if len(tops) != 1:
                raise DistBuildError(f"{sdist.name}: expected one top-level folder, found {sorted(tops)[:5]}")
            staging = dest.parent / f"{dest.name}.unpack"
            safe_extractall(archive, members, staging, sdist.name)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise DistBuildError(f"{sdist.name}: cannot unpack: {exc}") from None
    (staging / tops.pop()).rename(dest)
    staging.rmdir()


def _conflict_message(patch: Patch, stderr: str) -> str:
    failed = re.findall(r"error: patch failed: (.+):(\d+)", stderr)
    missing = re.findall(r"error: (.+): (does not exist in index|No such file or directory)", stderr)
    context = re.search(r"error: while searching for:\n(.*?)\nerror:", stderr, re.S)
    where = ", ".join(f"{path} hunk at line {line}" for path, line in failed) or ", ".join(
        f"{path} ({why})" for path, why in missing
    ) or "see git's message below"
    message = f"patch {patch.name} does not apply: {where}"
    if context:
        snippet = "\n".join("    " + line for line in context.group(1).splitlines()[:8])
        message += f"\n  the hunk expects this context:\n{snippet}"
    return message + f"\n  git said: {stderr.strip().splitlines()[-1] if stderr.strip() else '(nothing)'}"


def apply_patch(repo: Repo, patch: Patch) -> None:
    """``git am`` one patch: exact context (no fuzz), one commit, or a PatchConflict."""
    result = repo.git("am", "-q", "--no-3way", "--keep-cr", "--keep-non-patch", str(patch.path.resolve()), check=False)
    if result.returncode != 0:
        stderr = result.stderr.decode(errors="replace") + result.stdout.decode(errors="replace")
        repo.git("am", "--abort", check=False)
        raise PatchConflict(_conflict_message(patch, stderr))


def build_tree(upstream: str, sdist: Path, pin: Pin, patches: list[Patch], dest: Path) -> Repo:
    unpack_sdist(sdist, dest)
    repo = Repo(dest)
    repo.init()
    repo.commit_all(f"pristine {pin.filename}\n\nsha256: {pin.sha256}\n")
    repo.set_ref(PRISTINE_REF, repo.head())
    for patch in patches:
        apply_patch(repo, patch)
    repo.set_ref(PREPARED_REF, repo.head())
    return repo


def check_existing(upstream: str, dest: Path, force: bool) -> None:
    """Refuse to replace work a developer has not exported (unless forced)."""
    if not dest.exists() or force:
        return
    repo = Repo(dest)
    if not repo.is_repo():
        raise DistBuildError(f"{dest}: exists but is not a prepared tree; remove it or run with FORCE=1")
    dirty = repo.dirty()
    if dirty:
        shown = "; ".join(line.strip() for line in dirty[:5])
        raise DistBuildError(
            f"{dest}: has uncommitted changes ({shown}{' ...' if len(dirty) > 5 else ''}); "
            f"commit and `make export` to keep them, or rerun with FORCE=1 to discard them"
        )
    prepared = repo.ref(PREPARED_REF)
    if prepared is None or repo.head() != prepared:
        raise DistBuildError(
            f"{dest}: HEAD has commits that are not in patches/{upstream}/ "
            f"(run `make export UPSTREAM={upstream}` to keep them, or rerun with FORCE=1 to discard them)"
        )


STAMP = "dist-stamp"


def stamp_of(pin: Pin, patches: list[Patch]) -> str:
    """What a prepared tree was made from: the sdist hash and every patch's hash, in order."""
    return "\n".join([pin.sha256, *(f"{p.name} {p.sha256}" for p in patches)]) + "\n"


def up_to_date(dest: Path, stamp: str) -> bool:
    repo = Repo(dest)
    stamp_file = dest / ".git" / STAMP
    return (
        repo.is_repo()
        and stamp_file.is_file()
        and stamp_file.read_text() == stamp
        and repo.ref("HEAD") == repo.ref(PREPARED_REF)
        and not repo.dirty()
    )


def prepare(upstream: str, pin: Pin, sdist: Path, patches: list[Patch], src_root: Path, force: bool = False,
            log: Callable[[str], None] = print) -> PreparedTree:
    dest = src_root / upstream
    src_root.mkdir(parents=True, exist_ok=True)
    for stale in src_root.glob(f".{upstream}.*"):
        log(f"removing {stale} left by an interrupted run")
        shutil.rmtree(stale, ignore_errors=True)
    check_existing(upstream, dest, force)
    stamp = stamp_of(pin, patches)
    if dest.exists() and up_to_date(dest, stamp):
        repo = Repo(dest)
        pristine, head = repo.ref(PRISTINE_REF), repo.head()
        return PreparedTree(upstream, dest, pristine, repo.tree(pristine), head, repo.tree(head), patches, False)
    staging = src_root / f".{upstream}.new-{os.getpid()}"
    try:
        repo = build_tree(upstream, sdist, pin, patches, staging)
        pristine, head = repo.ref(PRISTINE_REF), repo.head()
        pristine_tree, patched_tree = repo.tree(pristine), repo.tree(head)
        current = Repo(dest)
        changed = not (dest.exists() and current.is_repo() and current.ref("HEAD") == head and not current.dirty())
        if changed:
            if dest.exists():
                old = src_root / f".{upstream}.old-{os.getpid()}"
                dest.rename(old)
                staging.rename(dest)
                shutil.rmtree(old, ignore_errors=True)  # already swapped out; a leftover is removed next run
            else:
                staging.rename(dest)
        (dest / ".git" / STAMP).write_text(stamp)
        result = PreparedTree(upstream, dest, pristine, pristine_tree, head, patched_tree, patches, changed)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return result


def tree_hashes(path: Path) -> tuple[str, str] | None:
    """(pristine tree, patched tree) of an already prepared tree, or None."""
    repo = Repo(path)
    if not repo.is_repo():
        return None
    pristine = repo.ref(PRISTINE_REF)
    prepared = repo.ref(PREPARED_REF)
    if pristine is None or prepared is None:
        return None
    return repo.tree(pristine), repo.tree(prepared)
