"""The image's Debian source fetch (image/imagectl/debsource.py) against a loopback HTTP
mirror laid out like Debian's pool: the verified file, the cache, and a corrupted file refused."""
from __future__ import annotations

import functools
import hashlib
import http.server
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.image.conftest import REPO

sys.path.insert(0, str(REPO / "image"))
from imagectl import debsource  # noqa: E402

DOCKERFILE = REPO / "Dockerfile"


@pytest.fixture
def mirror(tmp_path: Path):
    root = tmp_path / "mirror"
    pool = root / "pool" / "main" / "libf" / "libfabric"
    pool.mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield pool, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "image" / "imagectl" / "debsource.py"), *args],
                          capture_output=True, text=True)


def test_the_pinned_file_is_fetched_from_the_pool_then_served_from_the_cache(mirror, tmp_path):
    pool, url = mirror
    body = b"libfabric tarball bytes" * 1000
    (pool / "libfabric_2.1.0.orig.tar.xz").write_bytes(body)
    pin = hashlib.sha256(body).hexdigest()
    cache, out = tmp_path / "cache", tmp_path / "out" / "lf.tar.xz"
    done = _run("--source", "libfabric", "--file", "libfabric_2.1.0.orig.tar.xz", "--sha256", pin,
                "--cache", str(cache), "--out", str(out), "--mirror", url)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == body
    assert f"{url}/pool/main/libf/libfabric/libfabric_2.1.0.orig.tar.xz" in done.stdout
    # The mirror loses the file: the verified cache copy is used, no network needed.
    (pool / "libfabric_2.1.0.orig.tar.xz").unlink()
    out.unlink()
    again = _run("--source", "libfabric", "--file", "libfabric_2.1.0.orig.tar.xz", "--sha256", pin,
                 "--cache", str(cache), "--out", str(out), "--mirror", url)
    assert again.returncode == 0, again.stderr
    assert out.read_bytes() == body and str(cache / "libfabric_2.1.0.orig.tar.xz") in again.stdout


def test_a_corrupted_file_is_refused_naming_both_hashes_and_nothing_is_written(mirror, tmp_path):
    pool, url = mirror
    good = b"the real tarball"
    (pool / "libfabric_2.1.0.orig.tar.xz").write_bytes(b"the real tarball, one byte flipped!")
    pin = hashlib.sha256(good).hexdigest()
    got = hashlib.sha256(b"the real tarball, one byte flipped!").hexdigest()
    cache, out = tmp_path / "cache", tmp_path / "out" / "lf.tar.xz"
    done = _run("--source", "libfabric", "--file", "libfabric_2.1.0.orig.tar.xz", "--sha256", pin,
                "--cache", str(cache), "--out", str(out), "--mirror", url)
    assert done.returncode == 1
    assert f"sha256 {got}, the pin says {pin}" in done.stderr
    assert "pool/main/libf/libfabric/libfabric_2.1.0.orig.tar.xz" in done.stderr
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir()))
    assert list(cache.iterdir()) == []


def test_a_missing_file_and_a_malformed_pin_are_named(mirror, tmp_path):
    _pool, url = mirror
    missing = _run("--source", "libfabric", "--file", "libfabric_9.9.9.orig.tar.xz", "--sha256", "0" * 64,
                   "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--mirror", url)
    assert missing.returncode == 1 and "libfabric_9.9.9.orig.tar.xz" in missing.stderr and "404" in missing.stderr
    bad = _run("--source", "libfabric", "--file", "x.tar.xz", "--sha256", "abc",
               "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--mirror", url)
    assert bad.returncode == 1 and "'abc': not a sha256" in bad.stderr
    assert not (tmp_path / "o").exists()


def test_the_mirror_is_the_one_apt_uses(tmp_path):
    deb822 = tmp_path / "debian.sources"
    deb822.write_text("Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm\n\n"
                      "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n")
    assert debsource.configured_mirror((deb822,)) == "http://mirror.example/debian"
    one_line = tmp_path / "sources.list"
    one_line.write_text("# comment\ndeb [signed-by=/k.gpg] http://m2.example/debian bookworm main\n")
    assert debsource.configured_mirror((tmp_path / "absent", one_line)) == "http://m2.example/debian"
    assert debsource.configured_mirror((tmp_path / "absent",)) == debsource.DEFAULT_MIRROR
    assert debsource.pool_path("libfabric", "f") == "pool/main/libf/libfabric/f"
    assert debsource.pool_path("tini", "f") == "pool/main/t/tini/f"


def test_the_dockerfile_pins_the_libfabric_tarball_it_builds():
    text = DOCKERFILE.read_text()
    assert "ARG LIBFABRIC_VERSION=2.1.0" in text
    assert "ARG LIBFABRIC_ORIG_SHA256=1a66369772d5bb151737214af1c478993e969cf298e8f9ed369e7a2ab8d8c6df" in text
    assert "imagectl/debsource.py" in text and "--enable-efa=yes" in text and "--with-cuda=/opt/cuda" in text
