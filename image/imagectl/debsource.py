"""Fetch one file of a Debian source package from the pool by its pinned sha256.

The image builds libfabric from Debian's own upstream tarball
(``libfabric_2.1.0.orig.tar.xz``, trixie's source package): the one release the
image's NIXL LIBFABRIC plugin and the EFA provider both need, which bookworm does
not carry as a binary. The pool is shared by every suite of the archive, so the
file is at ``<mirror>/pool/main/<prefix>/<source>/<file>`` on the mirror the base's
apt already uses. Runs in a Dockerfile stage with the image's python3, stdlib only:

    python3 debsource.py --source libfabric --file libfabric_2.1.0.orig.tar.xz \\
        --sha256 1a66...c6df --cache /var/cache/dist/debian-src --out /work/libfabric.orig.tar.xz

The cache keeps the verified file (a build without network reuses it); a file
whose sha256 is not the pin is refused naming both hashes and its URL, and nothing
is written at ``--out`` or in the cache.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

SOURCES = (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list"))
DEFAULT_MIRROR = "http://deb.debian.org/debian"
TIMEOUT_S = 60


class FetchError(RuntimeError):
    pass


def configured_mirror(sources: tuple[Path, ...] = SOURCES) -> str:
    """The archive (not the security suite) apt is configured with: deb822 ``URIs:`` or a
    one-line ``deb URL suite`` entry; else deb.debian.org."""
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("URIs:") and "security" not in line:
                return line.split(":", 1)[1].split()[0].rstrip("/")
            if line.startswith("deb ") and "security" not in line:
                words = [w for w in line.split()[1:] if not w.startswith("[")]
                if words:
                    return words[0].rstrip("/")
    return DEFAULT_MIRROR


def pool_path(source: str, filename: str) -> str:
    """Debian's pool layout: ``lib`` sources are filed under their first four letters."""
    prefix = source[:4] if source.startswith("lib") else source[0]
    return f"pool/main/{prefix}/{source}/{filename}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(url: str, dest: Path) -> None:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, dest.open("wb") as out:
            shutil.copyfileobj(response, out)
    except (urllib.error.URLError, OSError) as exc:
        raise FetchError(f"{url}: {exc}") from exc


def fetch(source: str, filename: str, sha256: str, cache: Path, out: Path, mirror: str | None = None) -> str:
    """Put the verified file at ``out``; returns where it came from (the cache or a URL)."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise FetchError(f"--sha256 {sha256!r}: not a sha256 (64 lowercase hex digits)")
    cached = cache / filename
    origin = str(cached)
    if not (cached.is_file() and _sha256(cached) == sha256):
        url = f"{(mirror or configured_mirror()).rstrip('/')}/{pool_path(source, filename)}"
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=cache, prefix=f".{filename}.", suffix=".partial")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            _download(url, tmp)
            got = _sha256(tmp)
            if got != sha256:
                raise FetchError(f"{url}: sha256 {got}, the pin says {sha256} (a different or corrupted file; "
                                 f"nothing was written)")
            os.replace(tmp, cached)
        finally:
            tmp.unlink(missing_ok=True)
        origin = url
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    shutil.copyfile(cached, partial)
    os.replace(partial, out)
    return origin


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", required=True, help="Debian source package name, e.g. libfabric")
    p.add_argument("--file", required=True, help="file of that source package, e.g. libfabric_2.1.0.orig.tar.xz")
    p.add_argument("--sha256", required=True, help="the pinned sha256 (Checksums-Sha256 of the suite's Sources)")
    p.add_argument("--cache", type=Path, required=True, help="download cache folder")
    p.add_argument("--out", type=Path, required=True, help="where to put the verified file")
    p.add_argument("--mirror", help="archive URL (default: the one apt is configured with)")
    args = p.parse_args(argv)
    try:
        origin = fetch(args.source, args.file, args.sha256, args.cache, args.out, args.mirror)
    except FetchError as exc:
        print(f"debsource: {exc}", file=sys.stderr)
        return 1
    print(f"debsource: {args.out} ({args.file}, sha256 {args.sha256[:16]}..., from {origin})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
