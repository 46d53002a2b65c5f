"""vllm-router 0.1.17 in front of a P/D cell: what a prefill pod's death and a planned restart cost.

The chart's router pod runs two of them: the P/D router, and beside it (``prefillRetry``, the
default) a regular-mode router over the prefill pods that retries a failed prefill on another pod,
because the P/D mode cannot (below). The ``test_chart_router_*`` tests run the chart's own command
lines against a stand-in for the Kubernetes pod API; the static-URL cells measure the P/D router
alone.

Real parts: the vllm-router process (PyPI ``vllm-router==0.1.17``, the router the chart
deploys), two prefill and one decode ``tests/ops/fake_engine.py`` processes speaking vLLM
0.31.0's NIXL P/D hand-off (the router's ``kv_transfer_params`` and ``X-Request-Id`` in,
``kv_transfer_params`` with ``remote_request_id`` out) and vLLM 0.31.0's shutdown semantics,
and a streaming client load through the router.

What the router can and cannot promise (read from its source, vllm_router-0.1.17 sdist):

- It never retries a failed prefill in ``--vllm-pd-disaggregation`` mode:
  ``process_vllm_two_stage_request`` sends the prefill once and turns a connection error or a
  5xx into an error (src/routers/http/vllm_pd_router.rs:1775-1816); ``route_transparent``
  returns it to the client as a 500 (static URLs :3061-3087; discovery: ``process_vllm_request``
  :1403-1422). ``RetryExecutor`` is only used by the
  regular router (src/routers/http/router.rs:1525), and neither P/D router calls
  ``record_outcome``, so ``--retry-*`` and ``--cb-*`` do nothing here. A SIGKILLed prefill pod
  costs the requests routed to it until the health checker marks it unhealthy
  (src/core/worker.rs:407-460, one probe of ``--health-check-endpoint`` per
  ``--health-check-interval-secs``): the first test bounds that window and checks that the
  pod is skipped after it and used again when it is back.
- A planned restart costs nothing when the pod leaves the router before it stops admitting:
  on Kubernetes the router's pod watch removes a pod as soon as it has a deletionTimestamp
  (src/service_discovery.rs:352), the engine's preStop sleep covers the watch's latency, and
  vLLM's ``--shutdown-timeout`` drains what is in flight. Health checks alone cannot do it:
  vLLM 0.31.0's ``/health`` answers 200 while draining. One test removes the pod through the
  router's ``/remove_worker`` (the same registry removal the watch does, vllm_pd_router.rs:3099
  vs :2649), sleeps, SIGTERMs it, and asserts 0 failed requests; with vLLM's default
  ``--shutdown-timeout 0`` (abort) the pod's in-flight prefills end with ``finish_reason:
  "abort"`` and no ``kv_transfer_params``, and the router quietly sends their decode without
  them: no client error, but the decode pod prefills those prompts itself. The last test runs
  the chart's own router command line against ``KubeApiStub``, a stand-in for the Kubernetes
  API (none runs here) serving the pod LIST and WATCH the router makes, and plays the rollout
  with a deletionTimestamp, plus a pod of another cell and a pod that is not Ready yet.
- cache_aware (the chart's prefill policy) sends a prompt back to the pod that prefilled its
  prefix (it keys on the engines' ``/tokenize`` ids), and otherwise to the least-loaded pod
  (src/policies/cache_aware.rs:338-370), which after a SIGKILL is the dead one (it fails at
  once): inside the window it draws nearly every request; round_robin sends it 1/N.

The router is found through ``DIST_VLLM_ROUTER`` (the ``vllm-router`` executable), then
``work/venv-router/bin/vllm-router``, then ``PATH``; ``make test`` installs the pinned wheel
(build/pins.toml, sha256-checked) into ``work/venv-router`` and sets ``DIST_VLLM_ROUTER``;
elsewhere they skip, naming how to get it. The last test also needs
Helm (``DIST_HELM``, as tests/configs/test_deploy.py does).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

aiohttp = pytest.importorskip("aiohttp")
import aiohttp.web  # noqa: E402

from tests.ops.fake_engine import shutdown_runner  # noqa: E402
from tests.support.ports import free_loopback_port  # noqa: E402

# Bounds on hangs, not on speed: idle, a stand-in engine answers /health in about 1 s and a
# drained pod exits within its 30 s --shutdown-timeout; beside a loaded make test both took
# over 30 s and 60 s.
STARTUP_BOUND_S = 120.0
EXIT_BOUND_S = 180.0

REPO = Path(__file__).resolve().parents[2]
ROUTER_VERSION = "0.1.17"

# The router's prefill policy and health flags, as the chart passes them (configs/deploy/chart/values.yaml
# router.vllmRouter; tests/configs/test_deploy.py keeps the two equal). The chart's decode policy,
# power_of_two, refuses fewer than 2 static --decode URLs, so the static cells here use round_robin
# over their one decode engine; the discovery test runs the chart's own command line.
PREFILL_POLICY = "cache_aware"
DECODE_POLICY = "round_robin"
HEALTH_INTERVAL_S = 1
HEALTH_FAILURE_THRESHOLD = 1
HEALTH_SUCCESS_THRESHOLD = 1
HEALTH_TIMEOUT_S = 1
# A killed pod is probed at most one interval later and fails at once (connection refused);
# the rest is scheduling slack on a loaded 2-core machine.
DETECTION_WINDOW_S = HEALTH_INTERVAL_S * HEALTH_FAILURE_THRESHOLD + HEALTH_TIMEOUT_S + 1.0


def router_binary() -> str | None:
    candidates = [os.environ.get("DIST_VLLM_ROUTER", ""), str(REPO / "work/venv-router/bin/vllm-router"),
                  shutil.which("vllm-router") or ""]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


ROUTER = router_binary()
pytestmark = pytest.mark.skipif(
    ROUTER is None,
    reason=f"vllm-router {ROUTER_VERSION} not found: set DIST_VLLM_ROUTER to its executable "
    f"(python3 -m venv work/venv-router && work/venv-router/bin/pip install vllm-router=={ROUTER_VERSION})",
)


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer 200 within {timeout} s")


@dataclass
class Engine:
    """One fake engine process on a fixed port, restartable (a pod that comes back)."""

    port: int
    logdir: Path
    name: str
    prefill_rate: float
    shutdown_timeout: float = 0.0
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_path(self, start: int) -> Path:
        return self.logdir / f"{self.name}.{start}.jsonl"

    def start(self) -> None:
        self.starts += 1
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ops.fake_engine", "--host", self.host, "--port", str(self.port),
             "--prefill-rate", str(self.prefill_rate), "--decode-gap", "0.01",
             "--arrivals-log", str(self.log_path(self.starts)),
             "--shutdown-timeout", str(self.shutdown_timeout)],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(self.logdir / f"{self.name}.{self.starts}.err", "wb"))
        wait_http(self.url + "/health", STARTUP_BOUND_S, self.proc)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def events(self, start: int) -> list[dict[str, object]]:
        path = self.log_path(start)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Cell:
    prefills: list[Engine]
    decode: Engine
    router_port: int
    prefill_policy: str = PREFILL_POLICY
    router: subprocess.Popen[bytes] | None = None

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def start_router(self, logdir: Path) -> None:
        assert ROUTER is not None
        args = [ROUTER, "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                "--host", "127.0.0.1", "--port", str(self.router_port),
                "--prometheus-port", str(free_loopback_port()),
                "--prefill-policy", self.prefill_policy, "--decode-policy", DECODE_POLICY,
                "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
                "--health-failure-threshold", str(HEALTH_FAILURE_THRESHOLD),
                "--health-success-threshold", str(HEALTH_SUCCESS_THRESHOLD),
                "--health-check-timeout-secs", str(HEALTH_TIMEOUT_S),
                "--health-check-endpoint", "/health"]
        for engine in self.prefills:
            args += ["--prefill", engine.url]
        args += ["--decode", self.decode.url]
        self.router = subprocess.Popen(args, cwd=REPO, stdout=open(logdir / "router.out", "wb"),
                                       stderr=subprocess.STDOUT)
        wait_http(self.router_url + "/health", 60, self.router)

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait(10)
        for engine in [*self.prefills, self.decode]:
            engine.stop()


@pytest.fixture
def make_cell(tmp_path: Path):
    cells: list[Cell] = []

    def make(shutdown_timeout: float = 0.0, prefill_rate: float = 2_000.0,
             prefill_policy: str = PREFILL_POLICY) -> Cell:
        prefills = [Engine(free_loopback_port(), tmp_path, f"prefill{i}", prefill_rate, shutdown_timeout)
                    for i in range(2)]
        decode = Engine(free_loopback_port(), tmp_path, "decode", 2_000_000.0)
        cell = Cell(prefills, decode, free_loopback_port(), prefill_policy)
        cells.append(cell)
        for engine in [*prefills, decode]:
            engine.start()
        cell.start_router(tmp_path)
        return cell

    yield make
    for cell in cells:
        cell.stop()


@dataclass
class Outcome:
    start: float
    end: float
    ok: bool
    detail: str


@dataclass
class Load:
    """Streaming completions through the router from ``clients`` concurrent clients. Each prompt is
    distinct, or, with ``prefixes``, one of those shared prefixes (client i uses prefixes[i % len])
    followed by a distinct tail."""

    url: str
    clients: int
    prompt_words: int
    prefixes: list[str] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event | None = None

    def prompt(self, n: int) -> str:
        tail = f"request {n} " + " ".join(f"w{n}x{i}" for i in range(self.prompt_words))
        return f"{self.prefixes[n % self.clients % len(self.prefixes)]} {tail}" if self.prefixes else tail

    async def _one(self, http: aiohttp.ClientSession, n: int) -> None:
        body = {"model": "fake-glm", "prompt": self.prompt(n), "max_tokens": 4, "stream": True}
        start = time.monotonic()
        try:
            async with http.post(self.url + "/v1/completions", json=body) as response:
                text = await response.text()
                finishes = [json.loads(line[6:])["choices"][0].get("finish_reason")
                            for line in text.splitlines()
                            if line.startswith("data: {") and '"choices": [{' in line]
                ok = response.status == 200 and text.rstrip().endswith("data: [DONE]") and finishes[-1:] == ["length"]
                detail = f"{response.status} {text[:160]!r}"
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, IndexError) as error:
            ok, detail = False, repr(error)
        self.outcomes.append(Outcome(start, time.monotonic(), ok, detail))

    async def _client(self, http: aiohttp.ClientSession, first: int) -> None:
        assert self._stop is not None
        n = first
        while not self._stop.is_set():
            await self._one(http, n)
            n += self.clients

    async def run(self, script) -> None:
        """Run the load while ``script`` (a coroutine function) does the disruption."""
        self._stop = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            clients = [asyncio.create_task(self._client(http, i)) for i in range(self.clients)]
            try:
                await script()
            finally:
                self._stop.set()
                await asyncio.gather(*clients)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]


def prefill_arrivals(events: list[dict[str, object]]) -> list[float]:
    return [float(e["t"]) for e in events if e["event"] == "arrive" and e["prefill"]]  # type: ignore[arg-type]


def wait_for_prefill_arrival(engine: Engine, after: float, timeout: float) -> float:
    """When the first prefill after ``after`` (monotonic) arrived at ``engine``'s current start."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        arrivals = [t for t in prefill_arrivals(engine.events(engine.starts)) if t > after]
        if arrivals:
            return min(arrivals)
        time.sleep(0.02)
    raise AssertionError(f"{engine.name}: no prefill arrived within {timeout:.0f} s")


def post(url: str) -> int:
    request = urllib.request.Request(url, method="POST", data=b"")
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status


@pytest.mark.parametrize("prefill_policy", [PREFILL_POLICY, "round_robin"])
def test_prefill_kill_fails_only_requests_inside_detection_window_and_pod_is_reused(make_cell, prefill_policy) -> None:
    # No retry in the P/D path (see the module docstring): a SIGKILL costs the requests the
    # router sends to the dead pod before its next health probe. This asserts that bound, not 0.
    # cache_aware (the chart's) falls back to the least-loaded pod, and a dead pod, failing at
    # once, is always the least loaded: inside the window it draws nearly every request.
    # round_robin sends it every other one.
    cell = make_cell(prefill_policy=prefill_policy)
    victim, survivor = cell.prefills
    load = Load(cell.router_url, clients=6, prompt_words=60)
    marks: dict[str, float] = {}

    async def script() -> None:
        await asyncio.sleep(2.0)
        marks["kill"] = time.monotonic()
        victim.signal(signal.SIGKILL)
        victim.wait(10)
        await asyncio.sleep(DETECTION_WINDOW_S + 2.0)
        marks["back"] = time.monotonic()
        await asyncio.to_thread(victim.start)
        await asyncio.sleep(HEALTH_INTERVAL_S * HEALTH_SUCCESS_THRESHOLD + 3.0)
        marks["end"] = time.monotonic()

    asyncio.run(load.run(script))
    kill, back = marks["kill"], marks["back"]
    failures = load.failures()
    before = [o for o in load.outcomes if o.end < kill]
    after_window = [o for o in load.outcomes if o.start > kill + DETECTION_WINDOW_S]
    last = max((o.start for o in failures), default=kill)
    exposed = [o for o in load.outcomes if o.end >= kill and o.start <= last]
    print(f"\nkill test ({prefill_policy}): {len(load.outcomes)} requests, {len(failures)} failed, "
          f"{len(failures)} of the {len(exposed)} in flight at the kill or sent in the {last - kill:.3f} s after it")

    assert before and all(o.ok for o in before), [o.detail for o in before if not o.ok][:3]
    assert prefill_arrivals(victim.events(1)), "the victim served no prefill before the kill"
    late = [o for o in failures if o.start > kill + DETECTION_WINDOW_S or o.end < kill]
    assert not late, f"failures outside [kill, kill + {DETECTION_WINDOW_S} s]: {[o.detail for o in late][:3]}"
    assert len([o for o in after_window if o.start < back]) >= 10, "too little load after detection to judge"
    # After detection every request succeeds, so none went to the dead pod; the survivor served them.
    survivor_prefills = prefill_arrivals(survivor.events(1))
    assert any(kill + DETECTION_WINDOW_S < t < back for t in survivor_prefills)
    # The pod that came back (same URL, a new process) gets prefills again.
    reused = prefill_arrivals(victim.events(2))
    assert reused, "the restarted prefill pod got no traffic"
    assert min(reused) - back < HEALTH_INTERVAL_S * HEALTH_SUCCESS_THRESHOLD + 2.0 + 5.0
    assert all(o.ok for o in load.outcomes if o.start > back), "failures after the pod came back"


@pytest.mark.parametrize("shutdown_timeout", [30.0, 0.0], ids=["drain", "abort"])
def test_planned_prefill_restart_removed_first_then_drained_costs_no_request(make_cell, shutdown_timeout) -> None:
    # The rollout sequence: the pod leaves the router (on Kubernetes: the router's watch sees the
    # deletionTimestamp), preStop sleeps, SIGTERM, vLLM drains in-flight requests for up to
    # --shutdown-timeout. The abort case (vLLM's default --shutdown-timeout 0) is the control: the
    # requests the pod still had then lose their KV hand-off and the decode pod recomputes them.
    # Slow prefills (about 0.3 s each, FIFO) leave the victim a queue when SIGTERM comes.
    cell = make_cell(shutdown_timeout=shutdown_timeout, prefill_rate=400.0)
    victim, survivor = cell.prefills
    load = Load(cell.router_url, clients=8, prompt_words=120)
    marks: dict[str, float] = {}
    exit_code: list[int] = []

    async def script() -> None:
        await asyncio.sleep(3.0)
        # Removed as a prefill arrives there, which then outlasts the preStop sleep.
        await asyncio.to_thread(wait_for_prefill_arrival, victim, time.monotonic(), 10.0)
        assert await asyncio.to_thread(post, f"{cell.router_url}/remove_worker?url={victim.url}") == 200
        await asyncio.sleep(0.2)  # the preStop sleep, shorter than the victim's queue
        marks["term"] = time.monotonic()
        victim.signal(signal.SIGTERM)
        exit_code.append(await asyncio.to_thread(victim.wait, EXIT_BOUND_S))
        marks["exited"] = time.monotonic()
        await asyncio.sleep(2.0)

    asyncio.run(load.run(script))
    term = marks["term"]
    events = victim.events(1)
    arrived = {e["request_id"] for e in events if e["event"] == "arrive" and e["prefill"]}
    finished = {e["request_id"] for e in events if e["event"] == "finish" and e["prefill"]}
    finished_at = {e["request_id"]: float(e["now"]) for e in events if e["event"] == "finish" and e["prefill"]}  # type: ignore[arg-type]
    in_flight_at_term = [rid for rid in arrived if finished_at.get(rid, float("inf")) > term]
    failures = load.failures()
    print(f"\nplanned restart ({shutdown_timeout=}): {len(load.outcomes)} requests, {len(failures)} failed, "
          f"{len(in_flight_at_term)} prefills in flight on the victim at SIGTERM, "
          f"exit {marks['exited'] - term:.2f} s after it")

    assert exit_code == [0]
    assert in_flight_at_term, "the victim had nothing in flight at SIGTERM: the run proves no drain"
    assert not [e for e in events if e["event"] == "arrive" and float(e["t"]) > term], \
        "the router sent work to the pod after its removal"
    assert any(t > term for t in prefill_arrivals(survivor.events(1)))
    assert not failures, [o.detail for o in failures][:3]
    aborted = {e["request_id"] for e in events if e["event"] == "abort"}
    decode_events = cell.decode.events(1)
    local_prefills = [e for e in decode_events if e["event"] == "arrive" and not e["decode"]]
    if shutdown_timeout:
        # Every prefill the pod had finished and handed its KV over: the decode got no bare request.
        assert arrived == finished and not aborted
        assert not local_prefills
    else:
        # Aborted prefills answer 200 without kv_transfer_params; vllm-router then sends the decode
        # request without them (vllm_pd_router.rs:1872-1889, 586-591) and the decode pod prefills it itself.
        assert aborted == set(in_flight_at_term)
        assert len(local_prefills) == len(aborted)


def test_prefill_follows_a_shared_prefix(make_cell) -> None:
    # cache_aware (the chart's prefill policy) keys on the engines' /tokenize ids: a prompt whose
    # prefix a pod has already prefilled goes back to that pod, where its KV is in L1.
    cell = make_cell()
    prefixes = [" ".join(f"ctx{group}w{i}" for i in range(300)) for group in ("A", "B")]
    load = Load(cell.router_url, clients=6, prompt_words=10, prefixes=prefixes)

    async def script() -> None:
        await asyncio.sleep(4.0)

    asyncio.run(load.run(script))
    assert not load.failures()
    placement = {group: [sum(1 for e in engine.events(1) if e["event"] == "arrive" and e["prefill"]
                             and str(e["prompt_head"]).startswith(f"ctx{group}w0 "))
                         for engine in cell.prefills] for group in ("A", "B")}
    print(f"\nprefix affinity: prefills per pod {placement}")
    for group, counts in placement.items():
        assert sum(counts) >= 10, placement
        assert max(counts) >= 0.9 * sum(counts), f"group {group} spread over pods: {placement}"


class KubeApiStub:
    """The two Kubernetes API calls of vllm-router's pod watch (kube-runtime 1.1.0's ``watcher``
    with its default config, src/service_discovery.rs:290-305): LIST the namespace's pods, then
    WATCH them from the list's resourceVersion, as newline-delimited ``{"type", "object"}`` events.
    No API server runs here; this one serves a pod table the test edits, so the test can make a pod
    Ready, unready or deleted on demand. Every request is recorded (method, path, query)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.pods: dict[str, dict[str, object]] = {}
        self.events: list[tuple[int, str, dict[str, object]]] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.rv = 1
        self.port = free_loopback_port()
        self._loop = asyncio.new_event_loop()
        self._changed: asyncio.Condition | None = None
        self._runner: aiohttp.web.AppRunner | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "stub",
            "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
            "users": [{"name": "stub", "user": {"token": "stub"}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub", "namespace": self.namespace}}],
        }))
        return path

    def start(self) -> KubeApiStub:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _shutdown(self) -> None:
        assert self._runner is not None
        await shutdown_runner(self._runner)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._changed = asyncio.Condition()
        app = aiohttp.web.Application()
        app.router.add_get(f"/api/v1/namespaces/{self.namespace}/pods", self._pods)
        self._runner = runner = aiohttp.web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(aiohttp.web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _pods(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        query = dict(request.query)
        self.requests.append((request.method, request.path, query))
        if query.get("watch") not in ("true", "1"):
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": str(self.rv)},
                "items": list(self.pods.values())})
        since = int(query.get("resourceVersion") or 0)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        assert self._changed is not None
        while True:
            for rv, kind, pod in [e for e in self.events if e[0] > since]:
                await response.write(json.dumps({"type": kind, "object": pod}).encode() + b"\n")
                since = rv
            async with self._changed:
                await self._changed.wait()

    def put(self, name: str, ip: str, labels: dict[str, str], ready: bool, deleting: bool = False) -> None:
        """Create or update a pod (a MODIFIED event; deleting sets the deletionTimestamp a graceful delete sets)."""
        async def apply() -> None:
            assert self._changed is not None
            self.rv += 1
            metadata: dict[str, object] = {"name": name, "namespace": self.namespace, "uid": f"uid-{name}",
                                           "labels": labels, "resourceVersion": str(self.rv)}
            if deleting:
                metadata["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
                   "spec": {"containers": [{"name": "vllm", "image": "stub"}]},
                   "status": {"phase": "Running", "podIP": ip,
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
            kind = "MODIFIED" if name in self.pods else "ADDED"
            self.pods[name] = pod
            self.events.append((self.rv, kind, pod))
            async with self._changed:
                self._changed.notify_all()

        asyncio.run_coroutine_threadsafe(apply(), self._loop).result(10)


def chart_router_command(*values: str, name: str | None = None) -> list[str]:
    """A router container's command line as the chart renders it (configs/deploy/chart, real Helm):
    the P/D router (the first container), or ``name`` (``prefill-retry``)."""
    from tests.deploy.cell import by, container, render_cell

    return container(by(render_cell(*values), "Deployment", "glm53-pd-proxy"), name)["command"]


def localized(command: list[str], overrides: dict[str, str]) -> list[str]:
    """The chart's router command run here: the ``vllm-router`` executable for the launcher, and
    the value after each flag in ``overrides`` replaced (the addresses a pod has and this machine
    has not)."""
    assert ROUTER is not None
    assert command[:5] == ["/usr/bin/tini", "--", "python3", "-m", "vllm_router.launch_router"]
    rest = command[5:]
    return [ROUTER] + [overrides[rest[i - 1]] if i and rest[i - 1] in overrides else arg for i, arg in enumerate(rest)]


def labels(role: str, cell: str = "cell-a") -> dict[str, str]:
    return {"app.kubernetes.io/name": "glm53", "app.kubernetes.io/component": role, "glm53.io/cell": cell}


class ChartRouterPod:
    """What the chart's router pod runs, started here from the rendered commands: the P/D router
    and, with ``router.vllmRouter.prefillRetry.enabled`` (the default), the prefill-retry router
    beside it. Only what a pod has and this machine has not changes: the listen and metrics
    addresses, the engines' port (pods share 8000 on distinct IPs; here they share ``engine_port``
    on distinct loopback addresses) and the P/D router's loopback URL of the retry router."""

    def __init__(self, tmp_path: Path, api: KubeApiStub, engine_port: int, *values: str) -> None:
        from tests.deploy.cell import by, render_cell

        pod = by(render_cell(*values), "Deployment", "glm53-pd-proxy")["spec"]["template"]["spec"]
        self.commands = {c["name"]: c["command"] for c in pod["containers"]}
        self.port = free_loopback_port()
        self.retry_port = free_loopback_port()
        self.tmp_path = tmp_path
        self.env = {**os.environ, "KUBECONFIG": str(api.kubeconfig(tmp_path / "kubeconfig"))}
        self.env.pop("KUBERNETES_SERVICE_HOST", None)
        self.engine_port = engine_port
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _overrides(self, port: int) -> dict[str, str]:
        return {"--host": "127.0.0.1", "--port": str(port), "--service-discovery-port": str(self.engine_port),
                "--prometheus-host": "127.0.0.1", "--prometheus-port": str(free_loopback_port())}

    def start(self) -> ChartRouterPod:
        if "prefill-retry" in self.commands:
            command = self.commands["prefill-retry"]
            self._start("prefill-retry", localized(command, self._overrides(self.retry_port)))
            wait_http(f"http://127.0.0.1:{self.retry_port}/readiness", 60, self.procs["prefill-retry"])
        overrides = self._overrides(self.port)
        command = self.commands["proxy"]
        if "--prefill" in command:
            chart_url = command[command.index("--prefill") + 1]
            assert chart_url.startswith("http://127.0.0.1:"), chart_url
            overrides["--prefill"] = f"http://127.0.0.1:{self.retry_port}"
        self._start("proxy", localized(command, overrides))
        wait_http(self.url + "/readiness", 60, self.procs["proxy"])
        return self

    def _start(self, name: str, args: list[str]) -> None:
        self.procs[name] = subprocess.Popen(args, cwd=REPO, env=self.env,
                                            stdout=open(self.tmp_path / f"{name}.out", "wb"),
                                            stderr=subprocess.STDOUT)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


@contextlib.contextmanager
def running(engines: dict[str, Engine], api: KubeApiStub, routers: ChartRouterPod) -> Iterator[None]:
    """The engines started; on the way out the router pod, the engines and the pod API stopped."""
    try:
        for engine in engines.values():
            engine.start()
        yield
    finally:
        routers.stop()
        for engine in engines.values():
            engine.stop()
        api.stop()


def test_chart_router_follows_the_pod_watch_and_a_planned_restart_costs_no_request(tmp_path: Path) -> None:
    # The chart's router pod as shipped (the P/D router and the prefill-retry router beside it).
    engine_port = free_loopback_port()
    engines = {name: Engine(engine_port, tmp_path, name, 400.0, 30.0, host=f"127.0.0.{2 + i}")
               for i, name in enumerate(["prefill-0", "prefill-1", "decode-0", "prefill-2", "other-cell-prefill"])}
    # The pod deleted below prefills a prompt in about 1.2 s, longer than its preStop sleep
    # here (0.5 s), so the prefill that arrives just before the deletion is still running at
    # SIGTERM and the run proves a drain (at the others' 0.3 s, it proved one only when the
    # routing had queued prefills there).
    engines["prefill-0"].prefill_rate = 100.0
    api = KubeApiStub("vllm").start()
    routers = ChartRouterPod(tmp_path, api, engine_port)
    assert set(routers.commands) == {"proxy", "prefill-retry"}
    assert all(c[c.index("--service-discovery-namespace") + 1] == "vllm" for c in routers.commands.values())
    with running(engines, api, routers):
        api.put("prefill-0", engines["prefill-0"].host, labels("prefill"), ready=True)
        api.put("prefill-1", engines["prefill-1"].host, labels("prefill"), ready=True)
        api.put("decode-0", engines["decode-0"].host, labels("decode"), ready=True)
        api.put("prefill-2", engines["prefill-2"].host, labels("prefill"), ready=False)  # still starting
        api.put("other-cell-prefill", engines["other-cell-prefill"].host, labels("prefill", "cell-b"), ready=True)
        routers.start()
        router_url = routers.url
        load = Load(router_url, clients=8, prompt_words=120)
        marks: dict[str, float] = {}
        exit_code: list[int] = []
        victim = engines["prefill-0"]

        async def script() -> None:
            await asyncio.sleep(3.0)
            marks["ready"] = time.monotonic()
            await asyncio.to_thread(api.put, "prefill-2", engines["prefill-2"].host, labels("prefill"), True)
            await asyncio.sleep(3.0)
            # kubectl delete pod prefill-0, as a prefill starts there: the deletionTimestamp,
            # then preStop's sleep, then SIGTERM.
            await asyncio.to_thread(wait_for_prefill_arrival, victim, time.monotonic(), 10.0)
            await asyncio.to_thread(api.put, "prefill-0", victim.host, labels("prefill"), True, True)
            await asyncio.sleep(0.5)
            marks["term"] = time.monotonic()
            victim.signal(signal.SIGTERM)
            exit_code.append(await asyncio.to_thread(victim.wait, EXIT_BOUND_S))
            await asyncio.sleep(2.0)

        asyncio.run(load.run(script))

    ready, term = marks["ready"], marks["term"]
    failures = load.failures()
    victim_events = victim.events(1)
    arrived = {e["request_id"] for e in victim_events if e["event"] == "arrive" and e["prefill"]}
    finished_at = {e["request_id"]: float(e["now"]) for e in victim_events if e["event"] == "finish" and e["prefill"]}  # type: ignore[arg-type]
    in_flight_at_term = [rid for rid in arrived if finished_at.get(rid, float("inf")) > term]
    print(f"\ndiscovery: {len(load.outcomes)} requests, {len(failures)} failed, "
          f"{len(in_flight_at_term)} prefills in flight on the deleted pod at SIGTERM; API calls: "
          f"{[(m, q.get('watch', 'list')) for m, _, q in api.requests]}")

    assert any(q.get("watch") in ("true", "1") for _, _, q in api.requests), "the router never watched the pods"
    assert not prefill_arrivals(engines["other-cell-prefill"].events(1)), "a pod of another cell got traffic"
    late_pod = prefill_arrivals(engines["prefill-2"].events(1))
    assert late_pod and min(late_pod) > ready, "an unready pod got traffic, or the pod never got any once Ready"
    assert prefill_arrivals(engines["prefill-1"].events(1))
    assert exit_code == [0]
    assert in_flight_at_term, "the deleted pod had nothing in flight at SIGTERM: the run proves no drain"
    assert not [e for e in victim_events if e["event"] == "arrive" and float(e["t"]) > term]
    assert set(finished_at) == arrived and not [e for e in victim_events if e["event"] == "abort"]
    assert not failures, [o.detail for o in failures][:3]


def chart_cell_engines(tmp_path: Path, engine_port: int, prefill_rate: float) -> dict[str, Engine]:
    """prefill-0, prefill-1 and decode-0 on ``engine_port``, each on its own loopback address."""
    return {name: Engine(engine_port, tmp_path, name, 2_000_000.0 if name == "decode-0" else prefill_rate, 30.0,
                         host=f"127.0.0.{2 + i}")
            for i, name in enumerate(["prefill-0", "prefill-1", "decode-0"])}


@pytest.mark.parametrize("prefill_retry", [True, False], ids=["prefill-retry", "pd-router-alone"])
def test_chart_router_pod_retries_a_killed_prefill_on_another_pod(tmp_path: Path, prefill_retry: bool) -> None:
    # An unannounced prefill death (SIGKILL: OOM, a GPU fault, node loss) mid-run, through the chart's
    # router pod found by the pod watch. With the prefill-retry router (the chart's default) no
    # request fails: the prefills the dead pod held and those sent to it before its circuit opened
    # are retried on the survivor. The P/D router alone (prefillRetry.enabled=false) is the control:
    # it sends a prefill once, so the requests routed to the dead pod until the next probe fail.
    engine_port = free_loopback_port()
    # Slow prefills (about 0.15 s each, FIFO) so the victim holds a queue when it dies.
    engines = chart_cell_engines(tmp_path, engine_port, 800.0)
    api = KubeApiStub("vllm").start()
    routers = ChartRouterPod(tmp_path, api, engine_port,
                             f"router.vllmRouter.prefillRetry.enabled={str(prefill_retry).lower()}")
    assert ("prefill-retry" in routers.commands) is prefill_retry
    victim, survivor, decode = engines["prefill-0"], engines["prefill-1"], engines["decode-0"]
    load = Load(routers.url, clients=8, prompt_words=60)
    marks: dict[str, float] = {}
    with running(engines, api, routers):
        for name, engine in engines.items():
            api.put(name, engine.host, labels(name.split("-")[0]), ready=True)
        routers.start()

        async def script() -> None:
            await asyncio.sleep(3.0)
            marks["kill"] = time.monotonic()
            victim.signal(signal.SIGKILL)
            await asyncio.to_thread(victim.wait, 10)
            await asyncio.sleep(DETECTION_WINDOW_S + 2.0)
            marks["back"] = time.monotonic()
            await asyncio.to_thread(victim.start)  # the pod restarted in place (same IP and port)
            await asyncio.sleep(HEALTH_INTERVAL_S * HEALTH_SUCCESS_THRESHOLD + 4.0)

        asyncio.run(load.run(script))

    kill, back = marks["kill"], marks["back"]
    failures = load.failures()
    events = victim.events(1)
    finished = {e["request_id"] for e in events if e["event"] == "finish" and e["prefill"]}
    lost = [e["request_id"] for e in events
            if e["event"] == "arrive" and e["prefill"] and e["request_id"] not in finished]
    in_window = [o for o in load.outcomes if o.end >= kill and o.start <= kill + DETECTION_WINDOW_S]
    print(f"\nprefill SIGKILL ({'prefill-retry' if prefill_retry else 'P/D router alone'}): "
          f"{len(load.outcomes)} requests, {len(failures)} failed; {len(lost)} prefills died with the pod; "
          f"{len(in_window)} requests in flight at the kill or sent in the {DETECTION_WINDOW_S:.0f} s after it")

    assert prefill_arrivals(events), "the victim served no prefill before the kill"
    assert lost, "no prefill was in flight on the victim when it died: the run proves no retry"
    assert any(kill < t < back for t in prefill_arrivals(survivor.events(1)))
    assert prefill_arrivals(victim.events(2)), "the restarted prefill pod got no traffic"
    assert all(o.ok for o in load.outcomes if o.start > back + HEALTH_INTERVAL_S + 1.0)
    if prefill_retry:
        assert not failures, [o.detail for o in failures][:3]
        # Every decode got the KV of a prefill (the survivor's, for the retried ones): none recomputed.
        decode_events = decode.events(1)
        assert not [e for e in decode_events if e["event"] == "arrive" and not e["decode"]]
    else:
        assert failures, "the P/D router alone lost no request: the control cannot show what the retry adds"
        assert all(kill <= o.end and o.start <= kill + DETECTION_WINDOW_S for o in failures), \
            [o.detail for o in failures if not kill <= o.end][:3]


def test_chart_router_pod_sends_a_shared_prefix_to_one_prefill_pod(tmp_path: Path) -> None:
    # With the prefill-retry router, prefix affinity is its prefillPolicy (cache_aware) in regular
    # mode: the P/D router in front of it has one prefill worker and does not choose.
    engine_port = free_loopback_port()
    engines = chart_cell_engines(tmp_path, engine_port, 2_000.0)
    api = KubeApiStub("vllm").start()
    routers = ChartRouterPod(tmp_path, api, engine_port)
    assert "prefill-retry" in routers.commands
    prefixes = [" ".join(f"ctx{group}w{i}" for i in range(300)) for group in ("A", "B")]
    load = Load(routers.url, clients=6, prompt_words=10, prefixes=prefixes)
    with running(engines, api, routers):
        for name, engine in engines.items():
            api.put(name, engine.host, labels(name.split("-")[0]), ready=True)
        routers.start()

        async def script() -> None:
            await asyncio.sleep(4.0)

        asyncio.run(load.run(script))
    assert not load.failures()
    prefills = [engines["prefill-0"], engines["prefill-1"]]
    placement = {group: [sum(1 for e in engine.events(1) if e["event"] == "arrive" and e["prefill"]
                             and str(e["prompt_head"]).startswith(f"ctx{group}w0 "))
                         for engine in prefills] for group in ("A", "B")}
    print(f"\nprefix affinity through the chart's router pod: prefills per pod {placement}")
    for group, counts in placement.items():
        assert sum(counts) >= 10, placement
        assert max(counts) >= 0.9 * sum(counts), f"group {group} spread over pods: {placement}"
