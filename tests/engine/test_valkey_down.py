"""Valkey down under a real engine: killed mid-run, and not there at the start.

Killed mid-run (the shared prefill engine, shared.py): the engine keeps
serving by recomputing, without waiting for the lookup timeout, and its log
says the connection is gone; a new Valkey on the same port is used again.

Not there when configs/prefill starts (an engine of its own): the engine
starts and serves (LMCache's L1 keeps working), no request waits for the
lookup timeout, LMCache says why, and once Valkey is up LMCache stores to
it. Without patch 0002 a RESP worker whose first connect is refused exits
for good (``worker_loop_for_queue`` in csrc/storage_backends/connector_base.h):
every command then waits until ``blocking_timeout_secs``, every request pays
``lookup_timeout_ms``, and nothing reaches Valkey once it is up.
"""
from __future__ import annotations

import re
import time

import pytest

from tests.engine.conftest import Engines
from tests.engine.prompts import CHUNKS, OTHER_PROMPT, PROMPT, STORED
from tests.support import cpu_overlay
from tests.support.engine import observe
from tests.support.ports import free_port_block
from tests.support.valkey import start_valkey

REQUEST_TIMEOUT_S = 120.0  # a bound on a hang: above the shared engine's lookup_timeout_ms
# The native client's and the remote backend's words for a lost connection.
L2_DOWN = re.compile(r"Error occurred in batched_async_contains: .*|.*connection (failed|closed).*|"
                     r".*socket \w+ failed.*")
# The native client's report of a refused connect (patch 0002: it retries with a backoff).
CONNECT_REFUSED = re.compile(r"\[LMCache RESP\] connection to \S+ failed: [^\n]*")
# The scheduler giving up on a lookup: the request waited lookup_timeout_ms.
LOOKUP_GAVE_UP = re.compile(r"still waiting for async lookup after \d+ seconds, returning 0 .*recompute")
# A killed Valkey leaves each of LMCache's 32 RESP connections dead until a
# command on it fails (patch 0002 then reconnects it), and a batch with one
# failed command fails whole: the first stores after a restart fail, for a while.
RECOVERY_S = 90.0


class StoredNothing(AssertionError):
    """LMCache did not use a Valkey that came up after the engine."""


def _fresh_prompt(seed: int) -> list[int]:
    import random

    return [3 + random.Random(seed).randrange(2000) for _ in range(len(PROMPT))]


def _stores_again(server, valkey, seed: int, within_s: float = RECOVERY_S) -> float:
    """Seconds until a fresh prompt's chunks reach ``valkey``; fails after ``within_s``."""
    started = time.monotonic()
    while True:
        server.completion(_fresh_prompt(seed), timeout_s=REQUEST_TIMEOUT_S)
        seed += 1
        time.sleep(0.5)
        if valkey.client().dbsize() >= CHUNKS:
            return time.monotonic() - started
        if time.monotonic() - started > within_s:
            raise StoredNothing(f"LMCache stored nothing to the Valkey that came up {within_s:.0f} s ago")


@pytest.mark.engine
def test_valkey_killed_mid_run(shared_prefill):
    shared = shared_prefill
    shared.clear_l1()
    cold = observe(shared.server, [shared.valkey], OTHER_PROMPT, sets=[CHUNKS])
    assert cold.counts.stored == STORED and cold.calls[0].get("set") == CHUNKS, cold.summary()
    shared.clear_l1()

    shared.kill_valkey()
    try:
        mark = shared.server.log_mark()
        recomputed = shared.server.completion(OTHER_PROMPT, timeout_s=REQUEST_TIMEOUT_S)
        log = shared.server.log_since(mark)
        counts = shared.server.lmcache_counts(mark)
        assert counts.retrieved == 0, counts.lines
        # Neither tier holds the prompt now: a full recompute, so the cold run's split and logprobs.
        assert recomputed.tokens == cold.completion.tokens and recomputed.logprobs == cold.completion.logprobs
        waited = LOOKUP_GAVE_UP.search(log)
        assert waited is None, f"the lookup waited for the dead Valkey until its timeout: {waited.group(0)}"
        assert recomputed.seconds < cold.completion.seconds + 0.75 * shared.lookup_timeout_s, \
            f"{recomputed.seconds:.1f} s without Valkey, the cold run took {cold.completion.seconds:.1f} s"
        down = L2_DOWN.search(log)
        assert down is not None, f"the engine lost its Valkey without a word in its log:\n{log[-3000:]}"
    finally:
        shared.new_valkey()   # the shared engine's later users get a Valkey again
    recovered = _stores_again(shared.server, shared.valkey, seed=300)
    print(f"Valkey killed: recomputed in {recomputed.seconds:.2f} s (cold {cold.completion.seconds:.2f} s); "
          f"LMCache said {down.group(0).strip()[-160:]!r}; stored to the new Valkey after {recovered:.1f} s")


@pytest.fixture(scope="module")
def no_valkey(engine_python, tiny_model, tmp_path_factory):
    """configs/prefill started with nothing listening on rank 0's Valkey port."""
    workdir = tmp_path_factory.mktemp("no-valkey")
    engines = Engines(engine_python, workdir)
    base, api = free_port_block(1), free_port_block(2)
    spec = cpu_overlay.cpu_spec("prefill", tiny_model, base, label="prefill-no-valkey", api_port=api)
    try:
        yield engines.start(spec), spec, base, api, workdir
    finally:
        engines.stop_all()


@pytest.mark.engine
def test_engine_serves_without_its_valkey(no_valkey):
    server, spec, base, api, _ = no_valkey
    lookup_timeout_s = spec.lmcache_config["lookup_timeout_ms"] / 1000
    refused = CONNECT_REFUSED.search(server.log_text())
    assert refused is not None, f"LMCache did not say its Valkey is unreachable:\n{server.tail()}"

    mark = server.log_mark()
    cold = server.completion(PROMPT, timeout_s=REQUEST_TIMEOUT_S)
    log = server.log_since(mark)
    counts = server.lmcache_counts(mark)
    assert (counts.stored, counts.retrieved) == (STORED, 0), counts.lines   # into L1
    # A lookup against a Valkey that is not there fails at once: no wait for lookup_timeout_ms.
    gave_up = LOOKUP_GAVE_UP.search(log)
    assert gave_up is None, f"the lookup waited {lookup_timeout_s} s for the missing Valkey: {gave_up.group(0)}"

    # L1 still serves the prompt (after the same wait for the lookup).
    mark = server.log_mark()
    again = server.completion(PROMPT, timeout_s=REQUEST_TIMEOUT_S)
    counts = server.lmcache_counts(mark)
    assert counts.retrieved == STORED, counts.lines
    assert again.tokens == cold.tokens
    print(f"no Valkey at start: cold {cold.seconds:.2f} s, from L1 {again.seconds:.2f} s; "
          f"LMCache said {refused.group(0)[:160]!r}")


@pytest.mark.engine
@pytest.mark.fixes("0002-redis-connector-missing-key-is-a-miss.patch",
                   fails_with=r"LMCache stored nothing to the Valkey that came up")
def test_engine_uses_valkey_once_it_is_up(no_valkey):
    server, spec, base, api, workdir = no_valkey
    valkey = start_valkey(workdir, port=base)
    try:
        mark = server.log_mark()
        _stores_again(server, valkey, seed=400, within_s=20.0)
        gave_up = LOOKUP_GAVE_UP.search(server.log_since(mark))
        if gave_up is not None:
            raise StoredNothing(f"requests still wait for the lookup timeout: {gave_up.group(0)}")
    finally:
        valkey.stop()
