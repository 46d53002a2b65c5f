"""Proof of 0024-resp-connector-fail-commands-on-a-silent-server.patch.

A stalled Valkey (a real valkey-server stopped with SIGSTOP: a wedged or
swapping host) keeps its connections open and answers nothing. 0004 and 0019
bound how long LMCache's callers wait (``blocking_timeout_secs``), but the
native RESP workers underneath still wait in recv() for as long as the stall
lasts: a GET whose caller gave up keeps its buffers allocated (0004 must keep
them, C++ may still write into them), and a store stays in flight, holding
its key in ``put_tasks``. A stall of minutes holds that memory for minutes
(L1 cannot evict it) and every later command queues behind.

With the patch a native command whose send or recv makes no progress for
twice ``blocking_timeout_secs`` fails, the worker drops the connection and
backs off as after a failed connect, so the buffers are released and the
store completes as failed while the server is still stalled; once it answers
again the connector loads again.

Real parts: a valkey-server process, LMCache's RemoteBackend over its RESP
connector and native client (the Env of test_0003), on an event loop thread.
"""
from __future__ import annotations

import random
import time

import pytest

from tests.lmcache.test_0003_resp_per_key_results import CHUNK_BYTES, chunk_bytes
# env: 0019's RemoteBackend on the test's Valkey with blocking_timeout_secs = BLOCKING_TIMEOUT_S
from tests.lmcache.test_0019_resp_stalled_lookup import BLOCKING_TIMEOUT_S, env, stalled, timed  # noqa: F401

PATCH = "0024-resp-connector-fail-commands-on-a-silent-server.patch"
HELD = r"(stayed held|stayed in flight) while the server was stalled"

pytestmark = pytest.mark.lmcache

IO_TIMEOUT_S = 2 * BLOCKING_TIMEOUT_S   # what the patch derives from it
# after the native command's timeout: its worker's reconnect backoff, the
# executor and the allocator, on two busy cores
SLACK_S = 3.0
RECOVER_S = 5.0                 # the worker's reconnect backoff is at most 2 s


def wait_until(condition, deadline: float) -> bool:
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def loads_again(env, keys, stored) -> None:
    """The connector loads again once the server answers: a GET made while the
    worker still backs off is a miss (recompute), so ask until one loads."""
    deadline = time.monotonic() + RECOVER_S
    while True:
        loaded, _ = timed(lambda: env.backend.batched_get_blocking(keys), "a GET after the server resumed",
                          stalled_now=False)
        if all(obj is not None for obj in loaded):
            break
        for obj in loaded:
            if obj is not None:
                obj.ref_count_down()
        assert time.monotonic() < deadline, f"the connector did not load again within {RECOVER_S} s of the resume"
        time.sleep(0.1)
    assert [chunk_bytes(obj) for obj in loaded] == stored
    for obj in loaded:
        obj.ref_count_down()


@pytest.mark.fixes(PATCH, fails_with=HELD)
def test_abandoned_gets_release_their_buffers_while_the_server_is_stalled(env):
    keys = [env.key(i) for i in range(3)]
    stored = [env.store(i) for i in range(3)]

    with stalled(env.valkey):
        started = time.monotonic()
        loaded, seconds = timed(lambda: env.backend.batched_get_blocking(keys), "a batched GET")
        assert loaded == [None, None, None]
        assert seconds >= BLOCKING_TIMEOUT_S - 0.1, seconds
        released = wait_until(lambda: env.chunks_in_use() == 0, started + IO_TIMEOUT_S + SLACK_S)
        assert released, (
            f"{env.chunks_in_use()} buffer(s) of GETs nobody waits for stayed held while the server was stalled "
            f"({time.monotonic() - started:.1f} s after the GET, {BLOCKING_TIMEOUT_S} s after its caller gave up "
            f"and past the native workers' {IO_TIMEOUT_S} s without progress)")
        # and a GET made during the stall gives up too, without waiting for the first ones
        loaded, _ = timed(lambda: env.backend.batched_get_blocking(keys), "a second batched GET")
        assert loaded == [None, None, None]

    env.assert_back_at_baseline(timeout=IO_TIMEOUT_S + SLACK_S)
    loads_again(env, keys, stored)
    env.assert_back_at_baseline(timeout=2.0)


@pytest.mark.fixes(PATCH, fails_with=HELD)
def test_a_store_to_a_stalled_valkey_fails_instead_of_staying_in_flight(env):
    import torch

    key = env.key(7)
    data = random.Random(7).randbytes(CHUNK_BYTES)
    obj = env.local.allocate(torch.Size([CHUNK_BYTES]), torch.uint8)
    assert obj is not None
    obj.tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    failed_before = env.backend._put_failed_count

    with stalled(env.valkey):
        started = time.monotonic()
        future = env.backend.submit_put_task(key, obj)
        obj.ref_count_down()
        finished = wait_until(future.done, started + IO_TIMEOUT_S + SLACK_S)
        assert finished and not env.backend.exists_in_put_tasks(key), (
            f"the store stayed in flight while the server was stalled ({time.monotonic() - started:.1f} s, past "
            f"the native workers' {IO_TIMEOUT_S} s without progress): its key blocks every later store of it")
        assert env.backend._put_failed_count == failed_before + 1

    env.assert_back_at_baseline(timeout=IO_TIMEOUT_S + SLACK_S)
    # the worker is back once the server answers: a fresh store of the key lands
    deadline = time.monotonic() + RECOVER_S
    while True:
        obj = env.local.allocate(torch.Size([CHUNK_BYTES]), torch.uint8)
        obj.tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        future = env.backend.submit_put_task(key, obj)
        obj.ref_count_down()
        try:
            future.result(timeout=2 * IO_TIMEOUT_S)
        except RuntimeError:
            pass  # "waiting to reconnect": the worker still backs off; the next one lands
        with env.valkey.client() as client:
            if client.get(key.to_string()) == data:
                break
        assert time.monotonic() < deadline, f"no store landed within {RECOVER_S} s of the resume"
        time.sleep(0.1)
    env.assert_back_at_baseline(timeout=2.0)
