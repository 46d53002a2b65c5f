"""Proof of 0022-observability-count-lookups-that-time-out.patch: every lookup
that gives up after ``lookup_timeout_ms`` counts once in
``lmcache:num_lookup_timeouts``, and a lookup answered in time does not.

With async loading (the prefill preset) the scheduler's
LMCacheAsyncLookupClient asks the worker's LMCacheAsyncLookupServer and polls
``lookup_cache``; past ``lookup_timeout_ms`` it logs "still waiting for async
lookup ... returning 0" and vLLM recomputes the prompt. Pristine 0.5.5 counts
nothing there: an operator sees the timeouts only in the log (the write-up's
"3 s lookup timeouts on every request").

Real parts: a valkey-server stopped with SIGSTOP (a wedged shard: connections
stay open, nothing is answered), LMCache's engine with its RESP remote
backend, the real async lookup server and client over ZMQ, and LMCache's
Prometheus counter read from prometheus_client's registry under the
scheduler's labels. The server's remote lookup is bounded by
``blocking_timeout_secs`` (5 s), longer than ``lookup_timeout_ms`` (1.5 s),
so the client gives up first, as in the incident.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.lmcache.async_lookup import async_lookup
from tests.lmcache.test_0019_resp_stalled_lookup import stalled

PATCH = "0022-observability-count-lookups-that-time-out.patch"
NOT_COUNTED = r"lookups gave up after lookup_timeout_ms=\d+ but lmcache:num_lookup_timeouts_total rose by 0"

pytestmark = pytest.mark.lmcache

LOOKUP_TIMEOUT_MS = 1500
BLOCKING_TIMEOUT_S = 5  # the server's bound on its remote lookup (an int in LMCache config)
ANSWER_BOUND_S = 20.0   # a poll loop that gets no answer at all fails here
TIMED_OUT_LOOKUPS = 2
COUNTER = "lmcache:num_lookup_timeouts_total"


def timeouts_counted(scheduler_metadata) -> float:
    """The counter's value under the scheduler's labels (0 while it has no sample)."""
    from prometheus_client import REGISTRY

    from lmcache.observability import PrometheusLogger

    labels = PrometheusLogger.GetOrCreate(scheduler_metadata).labels
    value = REGISTRY.get_sample_value(COUNTER, {k: str(v) for k, v in labels.items()})
    return value or 0.0


def ask(client, tokens: list[int], lookup_id: str) -> tuple[int, float]:
    """Look up as vLLM's scheduler does (lookup_cache, lookup, then lookup_cache
    each step until it is not None): (hit tokens, seconds)."""
    started = time.monotonic()
    assert client.lookup_cache(lookup_id) == -1
    assert client.lookup(tokens, lookup_id=lookup_id) is None
    while (answer := client.lookup_cache(lookup_id)) is None:
        assert time.monotonic() - started < ANSWER_BOUND_S, f"{lookup_id}: no answer and no timeout"
    return answer, time.monotonic() - started


@pytest.mark.fixes(PATCH, fails_with=NOT_COUNTED)
def test_each_lookup_that_times_out_on_a_stalled_valkey_is_counted_once(valkey):
    from tests.support.pcp_ranks import valkey_engine_config

    config = valkey_engine_config(valkey.url)
    config.blocking_timeout_secs = BLOCKING_TIMEOUT_S
    config.lookup_timeout_ms = LOOKUP_TIMEOUT_MS
    try:
        with async_lookup(valkey, config, "lookup-timeouts") as pair:
            client, tokens = pair.client, pair.tokens
            start = timeouts_counted(pair.scheduler_metadata)
            pair.fresh_pod()
            hits, _ = ask(client, tokens, "answered-before")
            assert hits == len(tokens), f"the lookup on a healthy Valkey answered {hits} tokens"
            assert timeouts_counted(pair.scheduler_metadata) == start, "a lookup answered in time was counted"

            pair.fresh_pod()
            with stalled(valkey):
                for n in range(TIMED_OUT_LOOKUPS):
                    hits, seconds = ask(client, tokens, f"stalled-{n}")
                    assert hits == 0, f"a lookup nobody answered reported {hits} tokens"
                    # the client gave up on its own bound, before the server's remote lookup did
                    assert LOOKUP_TIMEOUT_MS / 1000 <= seconds < BLOCKING_TIMEOUT_S, seconds
                counted = timeouts_counted(pair.scheduler_metadata) - start
                assert counted == TIMED_OUT_LOOKUPS, (
                    f"{TIMED_OUT_LOOKUPS} lookups gave up after lookup_timeout_ms={LOOKUP_TIMEOUT_MS} "
                    f"but {COUNTER} rose by {counted:g}")

            # the server's late answers to the abandoned lookups count nothing more,
            # and a lookup answered in time after the stall counts nothing
            pair.fresh_pod()
            hits, _ = ask(client, tokens, "answered-after")
            assert hits == len(tokens), f"the lookup after the server resumed answered {hits} tokens"
            assert timeouts_counted(pair.scheduler_metadata) - start == TIMED_OUT_LOOKUPS
    finally:
        os.kill(valkey.process.pid, signal.SIGCONT)
