"""profile-capture against the real engine: py-spy dumps of its processes while a request runs.

The shared prefill engine (shared.py: configs/prefill on the CPU overlay) is
one process tree: the API server (``python -m
vllm.entrypoints.openai.api_server``), its ``VLLM::EngineCore`` and, under
the preset's expert parallelism, a multiprocess executor's
``VLLM::Worker_EP0`` (and multiprocessing's resource tracker). The tool runs
as an operator runs it, ``scripts/profile-capture pyspy --root-pid <API
server>`` (``--root-pid``: on a machine shared with other engines, the title
search would dump theirs too), while a streamed request is generating: its
first tokens arrived before the capture and vLLM's own
``vllm:num_requests_running`` gauge still counts it after.

Each role's dump must show the real engine's frames: vLLM's entrypoint in
the API server; the engine core's busy loop inside ``EngineCore.step``
(serving), LMCache's scheduler-side lookup client and NIXL's handshake
listener (the preset's connector graph); the worker's busy loop and
LMCache's worker-side threads. A dump is one instant: the engine core is in
``step`` for most of a decode step but not all of it, so the capture is
taken again (at most three times, each with a request of its own) when it
caught the loop between steps.

py-spy reads other processes through ptrace: as root, or with
``CAP_SYS_PTRACE`` in a container (docker run --cap-add SYS_PTRACE).
"""
from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.engine.conftest import REPO
from tests.engine.prompts import PROMPT

RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", re.M)
CAPTURES = 3
TOOL_TIMEOUT_S = 180


def _requests_running(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        return sum(float(v) for v in RUNNING.findall(response.read().decode()))


class StreamedRequest:
    """A long greedy completion streamed from the engine; closing it aborts the request."""

    def __init__(self, port: int, model: str, prompt: list[int], max_tokens: int):
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True}
        self.connection.request("POST", "/v1/completions", json.dumps(body),
                                {"Content-Type": "application/json"})
        self.response = self.connection.getresponse()
        assert self.response.status == 200, self.response.read()[:2000]

    def first_token(self) -> str:
        while line := self.response.readline():
            if line.startswith(b"data: {"):
                return json.loads(line[6:])["choices"][0]["text"]
        raise AssertionError("the stream ended before its first token")

    def close(self) -> None:
        self.connection.close()


def _wait_idle(url: str) -> None:
    """Until the engine runs no request; 60 s bounds an abort that never lands, not its speed."""
    deadline = time.monotonic() + 60
    while _requests_running(url) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _requests_running(url) == 0, "an aborted request was still running after 60 s"


def _dumps(out: Path) -> dict[str, str]:
    """Each dump's text by role: api-server, engine-core, worker-<title>, other-<pid>."""
    roles = {}
    for path in sorted((out / "pyspy").glob("*.txt")):
        text = path.read_text()
        title = re.search(r"^# pid \d+ ppid \d+: (.*)$", text, re.M).group(1)
        if "vllm.entrypoints.openai.api_server" in title:
            role = "api-server"
        elif title.startswith("VLLM::EngineCore"):
            role = "engine-core"
        elif title.startswith("VLLM::Worker"):
            role = f"worker-{title.split()[0]}"
        else:
            role = f"other-{path.name}"
        roles[role] = text
    return roles


def _listening(port: int) -> bool:
    """A TCP socket of this machine listens on ``port`` (/proc/net/tcp, tcp6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


def _main_thread(text: str) -> str:
    """The stack of the dumped process's main thread."""
    match = re.search(r'^Thread \d+ \([^)]*\): "MainThread"\n((?:    .*\n?)*)', text, re.M)
    assert match is not None, text[:2000]
    return match.group(1)


@pytest.mark.engine
def test_pyspy_dumps_every_engine_process_while_it_serves(shared_prefill, tmp_path):
    server = shared_prefill.server
    model = server.spec.vllm_config.get("served-model-name", str(server.spec.model))
    assert _requests_running(server.url) == 0
    for capture in range(1, CAPTURES + 1):
        # A fresh request for each capture: 1,900 tokens is what the 2,048-token context
        # leaves, and a fast engine finishes them in about the time of two captures.
        request = StreamedRequest(server.port, model, PROMPT[:64], max_tokens=1900)
        try:
            request.first_token()
            out = tmp_path / f"capture-{capture}"
            started = time.monotonic()
            done = subprocess.run([sys.executable, str(REPO / "scripts/profile-capture"), "pyspy",
                                   "--root-pid", str(server.process.pid), "--out", str(out)],
                                  capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, cwd=REPO)
            seconds = time.monotonic() - started
            # Still generating after the capture: the dumps were taken while the request ran.
            running = _requests_running(server.url)
        finally:
            request.close()
        assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}{done.stderr}"
        assert running == 1, \
            f"capture {capture}: the request was no longer running after it ({running}, {seconds:.1f} s)"
        roles = _dumps(out)
        if "EngineCore.step (vllm/v1/engine/core.py" in _main_thread(roles.get("engine-core", "")):
            break
        _wait_idle(server.url)
    workers = sorted(r for r in roles if r.startswith("worker-"))
    assert {"api-server", "engine-core"} <= set(roles) and workers == ["worker-VLLM::Worker_EP0"], sorted(roles)
    assert len(done.stdout.splitlines()) == len(roles) and done.stdout.count(" ok ") == len(roles), done.stdout

    api = roles["api-server"]
    assert "(vllm/entrypoints/" in _main_thread(api) and "uvloop" in api, api[:3000]
    core = roles["engine-core"]
    assert "EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py" in _main_thread(core), core[:3000]
    assert "EngineCore.step (vllm/v1/engine/core.py" in _main_thread(core), \
        f"{CAPTURES} captures never caught the engine core in step():\n{_main_thread(core)}"
    assert "LMCacheAsyncLookupClient" in core and "(lmcache/" in core, core[:4000]
    assert "_nixl_handshake_listener (vllm/distributed/kv_transfer/kv_connector/v1/nixl/" in core, core[:4000]
    # ... listening on the side-channel port the harness gave this engine, not vLLM's default
    assert server.nixl_port not in (None, 5600) and _listening(server.nixl_port), server.nixl_port
    worker = roles[workers[0]]
    assert "WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py" in _main_thread(worker), \
        worker[:3000]
    assert "LMCacheAsyncLookupServer" in worker and "(lmcache/" in worker, worker[:4000]

    # The aborted request leaves the engine: later users find it idle.
    _wait_idle(server.url)
    server.check_healthy()
    print(f"profile-capture pyspy: {len(roles)} processes ({', '.join(sorted(roles))}) in {seconds:.1f} s, "
          f"capture {capture} of at most {CAPTURES}; the worker's main thread was in: "
          + "; ".join(line.strip() for line in _main_thread(worker).splitlines()[:3]))


@pytest.mark.engine
def test_window_names_the_missing_profiler_of_the_real_engine(shared_prefill, tmp_path):
    """The CPU overlay drops the preset's CUDA profiler: vLLM 0.31.0 then serves no
    /start_profile, and the tool says how to enable it, as it claims."""
    done = subprocess.run([sys.executable, str(REPO / "scripts/profile-capture"), "window",
                           "--url", shared_prefill.server.url, "--seconds", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, cwd=REPO)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "/start_profile: HTTP 404, the engine serves no profiling endpoints" in done.stderr, done.stderr
    assert """--profiler-config '{"profiler": "cuda"}'""" in done.stderr


@pytest.mark.engine
def test_a_request_that_does_not_answer_reports_the_engines_stacks(shared_prefill):
    """The harness's timeout report (tests/support/engine.py _post): a request cut off by
    its timeout fails with py-spy stacks of the engine's processes, not only its log."""
    from tests.support.engine import EngineError

    server = shared_prefill.server
    with pytest.raises(EngineError) as failure:
        # 1 ms: the request cannot answer in time, and the engine serves it on after the client left
        server.completion(PROMPT[:64], max_tokens=4, timeout_s=0.001)
    report = str(failure.value)
    assert "the engine's stacks at the timeout:" in report
    assert "VLLM::EngineCore" in report and "vllm.entrypoints.openai.api_server" in report, report[-3000:]
