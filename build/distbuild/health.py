"""Try the series against another upstream release, patch by patch.

For each patch, in series order, on a tree that has every earlier patch that
applied: ``applies`` (exact context), ``contained`` (the reverse applies:
upstream already has the change) or ``conflicts``. A conflicting patch is
skipped so the later ones are still judged.
"""
from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import DistBuildError
from .fetch import download, sha256_of
from .gitrepo import Repo
from .index import IndexClient
from .pins import Pin, normalize_name
from .prepare import unpack_sdist
from .series import Patch


@dataclass(frozen=True)
class PatchHealth:
    patch: str
    status: str  # applies | contained | conflicts
    detail: str = ""


def parse_spec(spec: str) -> tuple[str, str]:
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*", spec)
    if not match:
        raise DistBuildError(f"{spec!r}: expected NAME==VERSION, for example lmcache==0.5.6")
    return match.group(1), match.group(2)


def resolve_sdist(client: IndexClient, name: str, version: str) -> Pin:
    """The sdist of ``name==version`` on the index, as an unlocked pin (hash from the index)."""
    files = client.project_files(name)
    prefix = f"{normalize_name(name).replace('-', '_')}-{version}."
    alt_prefix = f"{normalize_name(name)}-{version}."
    for f in files:
        lower = f.filename.lower()
        if lower.endswith(".tar.gz") and (lower.startswith(prefix) or lower.startswith(alt_prefix)):
            if not f.sha256:
                raise DistBuildError(f"{f.filename}: the index gives no sha256; refusing to use it")
            return Pin(name, version, "sdist", "upstream", f.filename, f.sha256, f.size or 0, upstream=name)
    versions = sorted({m.group(1) for f in files if (m := re.match(r".*?-(\d[^-]*?)(?:\.tar\.gz|-)", f.filename))})
    hint = f" (the index has {', '.join(versions[-8:])})" if versions else " (the index has no such project)"
    raise DistBuildError(f"{name}=={version}: no sdist on the package index{hint}")


def check_series(sdist: Path, patches: list[Patch], workdir: Path) -> list[PatchHealth]:
    tree = workdir / "tree"
    unpack_sdist(sdist, tree)
    repo = Repo(tree)
    repo.init()
    repo.commit_all(f"pristine {sdist.name}")
    report: list[PatchHealth] = []
    for patch in patches:
        path = str(patch.path.resolve())
        forward = repo.git("apply", "--check", path, check=False)
        if forward.returncode == 0:
            repo.git("am", "-q", "--no-3way", "--keep-cr", "--keep-non-patch", path)
            report.append(PatchHealth(patch.name, "applies"))
            continue
        reverse = repo.git("apply", "--check", "--reverse", path, check=False)
        if reverse.returncode == 0:
            report.append(PatchHealth(patch.name, "contained", "upstream already has this change"))
            continue
        failures = re.findall(r"error: patch failed: (.+:\d+)", forward.stderr.decode(errors="replace"))
        missing = re.findall(r"error: (.+): No such file", forward.stderr.decode(errors="replace"))
        where = ", ".join(failures + [f"{m} missing" for m in missing]) or forward.stderr.decode().strip()[:200]
        report.append(PatchHealth(patch.name, "conflicts", where))
    return report


def health(spec: str, patches: list[Patch], cache: Path, client: IndexClient,
           log: Callable[[str], None] = print) -> list[PatchHealth]:
    name, version = parse_spec(spec)
    pin = resolve_sdist(client, name, version)
    target = cache / pin.filename
    if not (target.is_file() and sha256_of(target) == pin.sha256):
        url = client.find(name, pin.filename).url
        download(url, target, pin.sha256, pin.size or None)
    log(f"checking {len(patches)} patch(es) against {pin.filename} (sha256 {pin.sha256} from the index)")
    with tempfile.TemporaryDirectory(prefix="dist-health-", dir=cache.parent) as tmp:
        return check_series(target, patches, Path(tmp))


def format_report(spec: str, report: list[PatchHealth]) -> str:
    if not report:
        return f"{spec}: the series is empty; nothing to check"
    width = max(len(r.patch) for r in report)
    lines = [f"{'patch'.ljust(width)}  status      detail"]
    for r in report:
        lines.append(f"{r.patch.ljust(width)}  {r.status.ljust(10)}  {r.detail}")
    counts = {s: sum(r.status == s for r in report) for s in ("applies", "contained", "conflicts")}
    lines.append(f"{spec}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


__all__ = ["PatchHealth", "check_series", "format_report", "health", "parse_spec", "resolve_sdist"]
