"""Proof of 0025-async-lookup-back-off-without-holding-the-client-lock.patch:
a worker's answer that arrives while the scheduler backs off between polls is
recorded at once, not when the backoff ends.

With async loading vLLM's scheduler polls ``lookup_cache`` every step while
a request waits on its lookup, and LMCache backs off ``lookup_backoff_time``
(10 ms by default) in each poll. Pristine 0.5.5 sleeps there holding the
client's lock, which the client's response thread needs to record the
workers' answers. vLLM's engine core steps again at once while a request is
deferred, so the lock is free only between two steps, and whether an answer
gets in then is up to the host's scheduler: under load, answers were
recorded seconds late and lookups the worker had answered gave up after
``lookup_timeout_ms``.

Real parts: LMCache's engine with its RESP remote backend on a real Valkey,
the async lookup server and client over ZMQ, the prompt's chunks in Valkey.
The one thing forced is the interleaving: a backoff of BACKOFF_S seconds
(``lookup_backoff_time``, a config key) makes "the answer arrives during a
poll's backoff" certain instead of a race on the host's scheduler.
"""
from __future__ import annotations

import threading
import time

import pytest

from tests.lmcache.async_lookup import async_lookup

PATCH = "0025-async-lookup-back-off-without-holding-the-client-lock.patch"
WAITED = r"the worker's answer was recorded [\d.]+ s after the lookup was sent, when the poll's [\d.]+ s backoff ended"

pytestmark = pytest.mark.lmcache

BACKOFF_S = 8.0
ANSWER_BOUND_S = 2 * BACKOFF_S + 10   # no answer at all fails here


def _in_backoff(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside lookup_cache's time.sleep."""
    import sys

    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "lookup_cache":
            import linecache

            return "time.sleep(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return False


@pytest.mark.fixes(PATCH, fails_with=WAITED)
def test_an_answer_during_the_backoff_is_recorded_at_once(valkey):
    from tests.support.pcp_ranks import valkey_engine_config

    config = valkey_engine_config(valkey.url)
    config.lookup_timeout_ms = 120_000
    config.extra_config = {**(config.extra_config or {}), "lookup_backoff_time": BACKOFF_S}
    with async_lookup(valkey, config, "lookup-backoff") as pair:
        client = pair.client
        pair.fresh_pod()
        assert client.lookup_cache("backoff") == -1
        # the scheduler's next step polls the lookup and backs off
        polling = threading.Thread(target=client.lookup_cache, args=("backoff",), name="scheduler-step")
        polling.start()
        deadline = time.monotonic() + 10
        while not _in_backoff(polling):
            assert time.monotonic() < deadline, "the poll never backed off"
            time.sleep(0.001)
        # meanwhile the lookup goes out (lookup() sends without the lock, then backs off itself)
        sent = time.monotonic()
        threading.Thread(target=client.lookup, args=(pair.tokens, "backoff"), daemon=True).start()
        while client.reqs_status.get("backoff") is None:
            assert time.monotonic() - sent < ANSWER_BOUND_S, "the worker never answered"
            time.sleep(0.005)
        recorded_after = time.monotonic() - sent
        polling.join()
        print(f"the worker's answer was recorded {recorded_after:.3f} s after the lookup was sent "
              f"(the poll backed off {BACKOFF_S} s)")
        assert recorded_after < BACKOFF_S / 2, (
            f"the worker's answer was recorded {recorded_after:.1f} s after the lookup was sent, "
            f"when the poll's {BACKOFF_S} s backoff ended")
        assert client.reqs_status["backoff"] == len(pair.tokens)
