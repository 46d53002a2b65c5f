"""vLLM's own P/D toy proxy, run as a real process in front of fake engines.

The proxy is ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``
of the pinned vLLM sdist (the file the image carries as
``/opt/glm53/pd-proxy/toy_proxy_server.py``), taken from the sdist where the
build tool keeps its downloads (``$DIST_CACHE_DIR/downloads``, else
``work/cache``) with its sha256 checked against ``build/pins.toml``. It
sends each completion to a prefiller (``stream: false``, ``max_tokens: 1``),
then streams the decoder's answer back with ``media_type="application/json"``.
It needs fastapi, httpx and uvicorn (LMCache's requirements: in the test
venv).
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from distbuild.paths import Layout

REPO = Path(__file__).resolve().parents[2]
MEMBER = "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"


def _vllm_sdist() -> tuple[Path, str]:
    pins = tomllib.loads((REPO / "build" / "pins.toml").read_text())
    for artifact in pins.get("artifact", []):
        if artifact.get("upstream") == "vllm" and artifact.get("kind") == "sdist":
            return Layout.default(repo=REPO).cache / artifact["filename"], artifact["sha256"]
    raise LookupError(f"{REPO / 'build' / 'pins.toml'}: no vllm sdist artifact")


def toy_proxy_source(dest: Path) -> Path:
    """Extract the proxy from the pinned sdist into ``dest``; FileNotFoundError when the sdist is absent."""
    sdist, sha256 = _vllm_sdist()
    if not sdist.is_file():
        raise FileNotFoundError(f"{sdist}: the pinned vLLM sdist is not fetched (make fetch)")
    digest = hashlib.sha256()
    with sdist.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != sha256:
        raise ValueError(f"{sdist}: sha256 {digest.hexdigest()} is not the pinned {sha256}")
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as archive:
        member = archive.getmember(f"{top}/{MEMBER}")
        data = archive.extractfile(member).read()  # type: ignore[union-attr]
    path = dest / "toy_proxy_server.py"
    path.write_bytes(data)
    return path


@dataclass
class ToyProxy:
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start_toy_proxy(script: Path, port: int, prefill_port: int, decode_port: int, log_path: Path) -> ToyProxy:
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, str(script), "--host", "127.0.0.1", "--port", str(port),
         "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(prefill_port),
         "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(decode_port)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    log.close()
    proxy = ToyProxy(port, process, log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the toy proxy exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{proxy.url}/healthcheck", timeout=2) as resp:
                if resp.status == 200:
                    return proxy
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    proxy.stop()
    raise RuntimeError(f"the toy proxy did not answer /healthcheck within 60 s: {log_path.read_text()[-2000:]}")
