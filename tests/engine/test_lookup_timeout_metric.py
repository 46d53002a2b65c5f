"""A lookup that times out under the real engine shows on vLLM's /metrics
(patch 0022's lmcache:num_lookup_timeouts).

configs/prefill (async loading, lookup_timeout_ms 4000, blocking_timeout_secs
5) on the CPU overlay, its Valkey stopped with SIGSTOP after a cold request
stored the prompt: the scheduler's async lookup client gives up after
lookup_timeout_ms and the request recomputes; /metrics then counts that one
lookup, under role="scheduler".

The lookup client runs in vLLM's EngineCore process, the /metrics endpoint
in the API server process: the server shows LMCache's counters only when
PROMETHEUS_MULTIPROC_DIR is set for the engine's processes (vLLM's
get_prometheus_registry then reads every process's files; unset, with one API
server, it serves its own process's registry, which holds no lmcache:
series). The engine here gets a fresh directory of its own, as a pod would.

Not a strict-xfail proof of 0022 (tests/lmcache/test_0022_lookup_timeout_counter.py
is): the request's store after the recompute checks Valkey synchronously, which
without patch 0019 waits for the stopped server, so on the pristine tree this
scenario would fail on the request's timeout rather than on the missing counter.
"""
from __future__ import annotations

import os
import re
import signal
import urllib.request

import pytest

from tests.engine.conftest import Engines
from tests.engine.prompts import PROMPT, STORED
from tests.support import cpu_overlay
from tests.support.engine import clear_l1
from tests.support.ports import free_port_block
from tests.support.valkey import start_valkey

REQUEST_TIMEOUT_S = 60.0
LOOKUP_GAVE_UP = re.compile(r"still waiting for async lookup after \d+ seconds, returning 0 .*recompute")
SAMPLE = re.compile(r"^lmcache:num_lookup_timeouts_total\{([^}]*)\} ([0-9.e+-]+)$", re.M)


def lookup_timeouts(url: str) -> dict[str, float]:
    """lmcache:num_lookup_timeouts_total on /metrics: {labels: value}."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {labels: float(value) for labels, value in SAMPLE.findall(text)}


@pytest.mark.engine
def test_a_lookup_timeout_is_counted_on_the_engines_metrics(engine_python, tiny_model, tmp_path):
    valkey = start_valkey(tmp_path, port=free_port_block(1))
    engines = Engines(engine_python, tmp_path)
    try:
        api = free_port_block(2)
        spec = cpu_overlay.cpu_spec("prefill", tiny_model, valkey.port, label="prefill-lookup-timeouts",
                                    api_port=api)
        # a concrete URL: the pristine build has no {rank} template (patch 0006)
        spec.lmcache_config["remote_url"] = valkey.url
        multiproc = tmp_path / "prometheus"
        multiproc.mkdir()
        spec.env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc)
        lookup_timeout_s = spec.lmcache_config["lookup_timeout_ms"] / 1000
        assert lookup_timeout_s < spec.lmcache_config["blocking_timeout_secs"], \
            "the preset's remote lookup gives up before the scheduler's: no lookup would time out"
        server = engines.start(spec)

        mark = server.log_mark()
        cold = server.completion(PROMPT, timeout_s=REQUEST_TIMEOUT_S)
        counts = server.lmcache_counts(mark)
        assert counts.stored == STORED, counts.lines
        assert LOOKUP_GAVE_UP.search(server.log_since(mark)) is None
        before = lookup_timeouts(server.url)
        assert sum(before.values()) == 0, f"a lookup answered in time was counted: {before}"
        clear_l1(server, api)   # the next lookup must ask Valkey

        os.kill(valkey.process.pid, signal.SIGSTOP)
        try:
            mark = server.log_mark()
            recomputed = server.completion(PROMPT, timeout_s=REQUEST_TIMEOUT_S)
            log = server.log_since(mark)
            after = lookup_timeouts(server.url)
        finally:
            os.kill(valkey.process.pid, signal.SIGCONT)
        gave_up = LOOKUP_GAVE_UP.findall(log)
        assert len(gave_up) == 1, f"expected the one request's lookup to time out, the log says {gave_up}"
        assert recomputed.seconds >= lookup_timeout_s - 0.1, recomputed.seconds
        assert recomputed.tokens == cold.tokens
        assert after, f"vLLM's /metrics has no lmcache:num_lookup_timeouts_total sample ({len(gave_up)} lookup " \
                      f"timed out; PROMETHEUS_MULTIPROC_DIR={multiproc})"
        assert sum(after.values()) == len(gave_up), after
        assert all('role="scheduler"' in labels for labels, value in after.items() if value), after
        print(f"lookup timed out after {recomputed.seconds:.1f} s (lookup_timeout_ms "
              f"{lookup_timeout_s * 1000:.0f}); /metrics: {after}")
    finally:
        engines.stop_all()
        valkey.stop()
