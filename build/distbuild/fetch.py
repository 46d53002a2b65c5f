"""Download pinned files into the cache, verified before they are visible.

A file appears under its final name in ``work/cache/`` only after its sha256
matched the pin; a partial or mismatching download is deleted. A warm cache
never touches the network.
"""
from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

from .errors import DistBuildError
from .index import IndexClient
from .pins import Pin
from .progress import ProgressBar

CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def cached(pin: Pin, cache: Path) -> Path | None:
    """The cached file if present and intact; a corrupt one is removed."""
    path = cache / pin.filename
    if not path.is_file():
        return None
    if path.stat().st_size == pin.size and sha256_of(path) == pin.sha256:
        return path
    path.unlink()
    return None


def fetch(pin: Pin, cache: Path, client_factory: Callable[[], IndexClient], log: Callable[[str], None] = print) -> Path:
    """Return the verified local path of ``pin``, downloading it if needed."""
    hit = cached(pin, cache)
    if hit is not None:
        log(f"cached   {pin.filename}")
        return hit
    try:
        remote = client_factory().find(pin.name, pin.filename)
    except DistBuildError as exc:
        raise DistBuildError(
            f"{pin.filename}: not in {cache} and it cannot be fetched: {exc}"
        ) from None
    if remote.sha256 and remote.sha256 != pin.sha256:
        raise DistBuildError(
            f"{pin.filename}: the index lists sha256 {remote.sha256}, the lock file pins {pin.sha256}; "
            "refusing to download (refresh the pin with `make pin` if the upstream file really changed)"
        )
    download(remote.url, cache / pin.filename, expected_sha256=pin.sha256, expected_size=pin.size)
    return cache / pin.filename


def download(url: str, dest: Path, expected_sha256: str, expected_size: int | None) -> None:
    """Stream ``url`` to ``dest`` through a temporary name; verify size and sha256 first."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    digest = hashlib.sha256()
    written = 0
    try:
        with _open(url) as response, partial.open("wb") as out:
            total = expected_size or _content_length(response)
            bar = ProgressBar(f"fetch    {dest.name}", total)
            for block in iter(lambda: response.read(CHUNK), b""):
                out.write(block)
                digest.update(block)
                written += len(block)
                bar.update(len(block))
            bar.close()
        if expected_size is not None and written != expected_size:
            raise DistBuildError(
                f"{dest.name}: truncated download: got {written} bytes, expected {expected_size}"
            )
        actual = digest.hexdigest()
        if actual != expected_sha256:
            raise DistBuildError(
                f"{dest.name}: sha256 mismatch: expected {expected_sha256}, got {actual}; download deleted"
            )
        partial.replace(dest)
    finally:
        partial.unlink(missing_ok=True)


def _open(url: str):
    if url.startswith("file:"):
        return open(urllib.request.url2pathname(urllib.parse.urlsplit(url).path), "rb")
    try:
        return urllib.request.urlopen(url, timeout=180)
    except (urllib.error.URLError, OSError) as exc:
        raise DistBuildError(f"cannot download {url.rsplit('/', 1)[-1]}: {exc}") from None


def _content_length(response) -> int | None:
    length = getattr(response, "headers", {}).get("Content-Length") if hasattr(response, "headers") else None
    return int(length) if length else None


def copy_into_cache(source: Path, pin: Pin, cache: Path) -> Path:
    """Seed the cache from a local file (offline builders), verified like a download."""
    download(source.resolve().as_uri(), cache / pin.filename, pin.sha256, pin.size)
    return cache / pin.filename


__all__ = ["cached", "copy_into_cache", "download", "fetch", "sha256_of"]
