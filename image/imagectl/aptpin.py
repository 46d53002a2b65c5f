"""Debian packages at the exact versions and .deb sha256 that build/lock/debian.txt records.

Runs inside an image stage (or the debootstrap chroot) with Debian's own
python3, stdlib only. No dated snapshot of the archive is reachable from these
machines, so the lock pins each package of each stage by version and by the
sha256 of its .deb (apt itself checks the archive's signed index chain; this
checks the bytes against what was locked). A version the live suites no
longer carry fails the install naming the package: re-lock (`make
lock-debian`), which is how a security update enters the image.

    aptpin.py install --lock debian.txt --stage runtime    # in a Dockerfile RUN
    aptpin.py install --lock debian.txt --stage runtime --only tini   # some of a section
    aptpin.py resolve --stage runtime gcc g++ ...          # `make lock-debian`: prints the section
    aptpin.py resolve --stage base --all                   # every installed package (the base)

The lock: a ``[stage] top-level packages...`` header, then one
``name=version sha256`` line per package the stage installs (its closure).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ARCHIVES = Path("/var/cache/apt/archives")
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive", "PYTHONHASHSEED": "0", "LC_ALL": "C.UTF-8"}
# Files apt/dpkg write that hold the build's time or are caches: not part of what a stage installs.
VOLATILE = ("/var/log/dpkg.log", "/var/log/alternatives.log", "/var/log/apt", "/var/cache/ldconfig/aux-cache",
            "/var/lib/apt/lists", "/var/cache/apt/pkgcache.bin", "/var/cache/apt/srcpkgcache.bin",
            "/var/lib/dpkg/status-old", "/var/lib/dpkg/diversions-old", "/var/lib/dpkg/statoverride-old",
            "/var/cache/debconf/config.dat-old", "/var/cache/debconf/templates.dat-old")


class PinError(RuntimeError):
    pass


def parse_lock(text: str) -> dict[str, tuple[list[str], dict[str, tuple[str, str]]]]:
    """{stage: (top-level packages, {name: (version, sha256)})}."""
    out: dict[str, tuple[list[str], dict[str, tuple[str, str]]]] = {}
    current: str | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            head, _, rest = line[1:].partition("]")
            current = head.strip()
            out[current] = (rest.split(), {})
            continue
        if current is None:
            raise PinError(f"line {n}: {raw!r} before any [stage] header")
        spec, _, digest = line.partition(" ")
        name, eq, version = spec.partition("=")
        digest = digest.strip()
        if not eq or not version or len(digest) != 64:
            raise PinError(f"line {n}: {raw!r} is not 'name=version sha256'")
        out[current][1][name] = (version, digest)
    return out


def format_section(stage: str, top: list[str], entries: dict[str, tuple[str, str]]) -> str:
    lines = [f"[{stage}] {' '.join(top)}".rstrip()]
    lines += [f"{name}={version} {digest}" for name, (version, digest) in sorted(entries.items())]
    return "\n".join(lines) + "\n"


def installed() -> dict[str, str]:
    done = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}\t${Package}\t${Version}\n"],
                          capture_output=True, text=True, check=True)
    out: dict[str, str] = {}
    for line in done.stdout.splitlines():
        status, name, version = line.split("\t")
        if status.startswith("ii"):
            out[name] = version
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def debs(folder: Path = ARCHIVES) -> dict[tuple[str, str], Path]:
    out: dict[tuple[str, str], Path] = {}
    for path in sorted(folder.glob("*.deb")):
        fields = subprocess.run(["dpkg-deb", "-f", str(path), "Package", "Version"], capture_output=True,
                                text=True, check=True).stdout
        values = dict(line.split(": ", 1) for line in fields.splitlines() if ": " in line)
        out[(values["Package"], values["Version"])] = path
    return out


def apt(*args: str) -> None:
    done = subprocess.run(["apt-get", "-qq", "-o", "Dpkg::Use-Pty=0", *args], env={**os.environ, **APT_ENV},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise PinError(f"apt-get {' '.join(args[:3])}...: {(done.stderr or done.stdout).strip()[-2500:]}")


def clean() -> None:
    for path in VOLATILE:
        for hit in glob.glob(path):
            p = Path(hit)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                if path == "/var/lib/apt/lists":
                    (p / "partial").mkdir(parents=True, exist_ok=True)
            else:
                p.unlink(missing_ok=True)
    for deb in ARCHIVES.glob("*.deb"):
        deb.unlink()


def download(stage: str, specs: list[str]) -> None:
    """apt-get install --download-only of exact name=version specs; a version the suites no
    longer carry is named with the fix."""
    try:
        apt("install", "-y", "--no-install-recommends", "--allow-downgrades", "--download-only", *specs)
    except PinError as e:
        # apt: "E: Version '3.0.17-1~deb12u2' for 'libssl3' was not found": the live suites keep
        # only the newest security/point-release version, so a pin can vanish.
        gone = re.findall(r"Version '([^']+)' for '([^']+)' was not found", str(e))
        if not gone:
            raise
        raise PinError("; ".join(f"[{stage}] {name}={version}: apt did not fetch it (no longer in the "
                                 "suites? re-lock with `make lock-debian`)" for version, name in gone)) from None


def install(lock: Path, stage: str, exact: bool = False, only: tuple[str, ...] = ()) -> int:
    """The [stage] section's packages, or only the named ones of it (``only``: a stage that needs a few
    of another's, e.g. the router's tini): whatever apt adds beyond them fails the install."""
    sections = parse_lock(lock.read_text())
    if stage not in sections:
        raise PinError(f"{lock}: no [{stage}] section; run `make lock-debian`")
    _top, wanted = sections[stage]
    if only:
        unknown = [name for name in only if name not in wanted]
        if unknown:
            raise PinError(f"{lock}: [{stage}] locks no {', '.join(unknown)}")
        wanted = {name: wanted[name] for name in only}
    before = installed()
    todo = {n: v for n, (v, _) in wanted.items() if before.get(n) != v}
    if todo:
        apt("update")
        specs = [f"{n}={v}" for n, v in sorted(todo.items())]
        # Download first, check every .deb's sha256 against the lock, then install from the cache only.
        download(stage, specs)
        have = debs()
        for name, version in sorted(todo.items()):
            path = have.get((name, version))
            if path is None:
                raise PinError(f"[{stage}] {name}={version}: apt did not fetch it (no longer in the suites? "
                               "re-lock with `make lock-debian`)")
            got, expect = sha256(path), wanted[name][1]
            if got != expect:
                raise PinError(f"[{stage}] {path.name}: sha256 {got}, the lock says {expect}")
        apt("install", "-y", "--no-install-recommends", "--allow-downgrades", "--no-download", *specs)
    after = installed()
    wrong = [f"{n} {after.get(n, 'not installed')} (lock: {v})" for n, (v, _) in sorted(wanted.items())
             if after.get(n) != v]
    # The base (exact): the whole installed set is the lock; a stage: what it adds is.
    extra = sorted(set(after) - set(wanted)) if exact else sorted(set(after) - set(before) - set(wanted))
    if wrong or extra:
        raise PinError(f"[{stage}] installed set differs from the lock: " + "; ".join(
            wrong + [f"{n} {after[n]} not in the lock" for n in extra]))
    clean()
    print(f"aptpin: [{stage}] {len(wanted)} package(s) at their locked versions "
          f"({len(todo)} installed, sha256 checked)")
    return 0


def resolve(stage: str, packages: list[str], everything: bool) -> int:
    before = {} if everything else installed()
    if packages:
        apt("update")
        apt("install", "-y", "--no-install-recommends", *packages)
    elif everything:
        apt("update")
        apt("-y", "upgrade")   # the security and point-release updates into the base
    after = installed()
    changed = {n: v for n, v in after.items() if before.get(n) != v}
    have = debs()
    missing = [(n, v) for n, v in changed.items() if (n, v) not in have]
    with tempfile.TemporaryDirectory() as tmp:
        if missing:
            os.chmod(tmp, 0o777)   # apt-get download drops to _apt
            done = subprocess.run(["apt-get", "-qq", "download", *[f"{n}={v}" for n, v in missing]], cwd=tmp,
                                  env={**os.environ, **APT_ENV}, capture_output=True, text=True)
            if done.returncode != 0:
                raise PinError(f"apt-get download: {done.stderr.strip()[-2000:]}")
            have.update(debs(Path(tmp)))
        entries = {}
        for name, version in changed.items():
            path = have.get((name, version))
            if path is None:
                raise PinError(f"[{stage}] {name}={version}: no .deb found to hash")
            entries[name] = (version, sha256(path))
    sys.stdout.write(format_section(stage, packages, entries))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aptpin", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("install")
    s.add_argument("--lock", type=Path, required=True)
    s.add_argument("--stage", required=True)
    s.add_argument("--exact", action="store_true", help="the whole installed set must be the section (the base)")
    s.add_argument("--only", nargs="+", default=(), metavar="PACKAGE",
                   help="install only these packages of the section (their whole closure, or it fails)")
    s = sub.add_parser("resolve")
    s.add_argument("--stage", required=True)
    s.add_argument("--all", action="store_true", help="every installed package, after an upgrade (the base)")
    s.add_argument("packages", nargs="*")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "install":
            return install(args.lock, args.stage, args.exact, tuple(args.only))
        return resolve(args.stage, args.packages, args.all)
    except (PinError, OSError, subprocess.CalledProcessError) as exc:
        print(f"aptpin: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
