"""The P/D router's own image (the Dockerfile's router stage), run: what a router pod pulls and runs.

Needs the image ``make image`` builds beside the serving image, named by ``DIST_ROUTER_IMAGE``, and
podman or docker; ``make image-check`` sets it, ``make test`` does not (these then skip, saying so).

Real parts: the image's vllm-router (build/lock/router.txt) under its tini, read-only and as its
own user, in front of a prefill and a decode ``tests/ops/fake_engine.py`` process speaking vLLM's
NIXL P/D hand-off on this machine's loopback (``--network=host``), with streaming completions sent
through it.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from imagectl.selftest import ROUTER_FLAGS
from tests.deploy.test_router import Engine, Load, wait_http
from tests.support.ports import free_loopback_port

IMAGE = os.environ.get("DIST_ROUTER_IMAGE", "")
LAUNCHER = ["/usr/bin/tini", "--", "python3", "-m", "vllm_router.launch_router"]
# What a router pod must not pull: the serving stack. The serving image is about 10 GB; vllm-router's
# closure with Python is a few hundred MB.
SIZE_BOUND_BYTES = 600 * 10**6
STOP_GRACE_S = 60

pytestmark = pytest.mark.runtime_image


@pytest.fixture(scope="module")
def router_image() -> tuple[str, str]:
    if not IMAGE:
        pytest.skip("runs under make image-check (DIST_ROUTER_IMAGE names the router's image)")
    for name in ("podman", "docker"):
        engine = shutil.which(name)
        if engine and subprocess.run([engine, "info"], capture_output=True).returncode == 0:
            break
    else:
        pytest.fail("DIST_ROUTER_IMAGE is set but no podman or docker here can run containers", pytrace=False)
    if subprocess.run([engine, "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        pytest.fail(f"DIST_ROUTER_IMAGE={IMAGE}: no such image here (run `make image` first)", pytrace=False)
    return engine, IMAGE


def run(router_image: tuple[str, str], *argv: str, entrypoint: str | None = None) -> subprocess.CompletedProcess:
    engine, ref = router_image
    ep = [f"--entrypoint={entrypoint}"] if entrypoint else []
    return subprocess.run([engine, "run", "--rm", "--read-only", "--network=none", *ep, ref, *argv],
                          capture_output=True, text=True, timeout=300)


def test_the_router_image_runs_the_charts_launcher_as_its_user_without_the_serving_stack(router_image) -> None:
    engine, ref = router_image
    config = json.loads(subprocess.run([engine, "image", "inspect", "--format", "{{json .Config}}", ref],
                                       capture_output=True, text=True, check=True).stdout)
    assert config["User"] == "1000:0"
    assert config["Entrypoint"] == LAUNCHER
    size = int(subprocess.run([engine, "image", "inspect", "--format", "{{.Size}}", ref],
                              capture_output=True, text=True, check=True).stdout.strip())
    print(f"\n{ref}: {size / 1e6:.0f} MB")
    assert size < SIZE_BOUND_BYTES
    found = run(router_image, "-c", "import importlib.util as u; "
                "print([m for m in ('torch', 'vllm', 'lmcache', 'flashinfer', 'nixl') if u.find_spec(m)])",
                entrypoint="python3")
    assert (found.returncode, found.stdout.strip()) == (0, "[]"), found.stderr
    helped = run(router_image, "--help")
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert [flag for flag in ROUTER_FLAGS if flag not in helped.stdout] == []


def test_the_router_image_routes_pd_requests_and_stops_on_sigterm(router_image, tmp_path: Path) -> None:
    engine, ref = router_image
    prefill = Engine(free_loopback_port(), tmp_path, "prefill", 2_000.0)
    decode = Engine(free_loopback_port(), tmp_path, "decode", 2_000_000.0)
    port = free_loopback_port()
    name = f"glm53-router-check-{uuid.uuid4().hex[:8]}"
    try:
        prefill.start()
        decode.start()
        subprocess.run([engine, "run", "--detach", f"--name={name}", "--read-only", "--network=host", ref,
                        "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--host", "127.0.0.1",
                        "--port", str(port), "--prometheus-port", str(free_loopback_port()),
                        "--prefill-policy", "cache_aware", "--decode-policy", "round_robin",
                        "--health-check-interval-secs", "1", "--prefill", prefill.url, "--decode", decode.url],
                       capture_output=True, text=True, check=True)
        wait_http(f"http://127.0.0.1:{port}/health", 120)
        load = Load(f"http://127.0.0.1:{port}", clients=2, prompt_words=20)
        asyncio.run(load.run(lambda: asyncio.sleep(3.0)))
        assert load.outcomes and not load.failures(), load.failures()[:3]
        arrived = [(e["prefill"]) for e in prefill.events(1) + decode.events(1) if e["event"] == "arrive"]
        assert True in arrived and False in arrived
        # tini passes SIGTERM on; a Python PID 1 would ignore it and be killed at the end of the grace (137).
        subprocess.run([engine, "stop", f"--time={STOP_GRACE_S}", name], capture_output=True, check=True,
                       timeout=STOP_GRACE_S + 60)
        state = subprocess.run([engine, "inspect", "--format", "{{.State.ExitCode}}", name],
                               capture_output=True, text=True, check=True).stdout.strip()
        assert state in ("0", "143"), f"the router exited {state} on SIGTERM"
    finally:
        subprocess.run([engine, "rm", "--force", name], capture_output=True)
        prefill.stop()
        decode.stop()
