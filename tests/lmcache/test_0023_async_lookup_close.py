"""Proof of 0023-async-lookup-close-without-terminating-the-shared-context.patch.

The scheduler's LMCacheAsyncLookupClient (async loading, the prefill preset)
makes its sockets on ``zmq.Context.instance()``, the process-wide context,
and its ``close()`` ended with ``ctx.term()``, which blocks until every socket
of that context is closed, its own and everyone else's. vLLM's KV event
publisher (``--kv-events-config`` with the zmq publisher, what a KV-aware
router subscribes to) lives in the same EngineCore process on the same
context, so the connector's shutdown blocks there until the publisher is shut
down, which vLLM does after the connector: the engine does not exit until it
is killed. Before that, ``close()`` closed the pull socket under its own
receive thread, blocked in ``recv()`` with no bound (a ZMQ socket must not be
used from two threads).

Real parts: vLLM 0.31.0's ZmqEventPublisher (from the test venv's vLLM wheel)
and LMCache's async lookup client in one process, as in EngineCore. That
process is a child of the test, with a bound: unpatched, its close() blocks,
or libzmq aborts it ("Assertion failed: pfd.revents & POLLIN", the socket
closed under the thread's recv()), and either must fail this test, not the
test run.
"""
from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

PATCH = "0023-async-lookup-close-without-terminating-the-shared-context.patch"
BLOCKED = r"close\(\) did not return beside vLLM's KV event publisher"

pytestmark = pytest.mark.lmcache

# The child bounds its own close(): unpatched it blocks for ever, and the bound must
# not include the imports, which take 5 s idle and over 30 s beside the rest of CI.
CLOSE_BOUND_S = 10   # a patched close() takes about 1 s (the thread wakes on its poll)
CHILD_BOUND_S = 300  # only a child that hangs before close() meets this

# EngineCore's scheduler side, reduced: vLLM's KV event publisher and LMCache's
# async lookup client on the process-wide ZMQ context, then the connector's close().
CHILD = r"""
import linecache
import os
import sys
import threading
import time
from vllm.distributed.kv_events import ZmqEventPublisher
from lmcache.v1.lookup_client.lmcache_async_lookup_client import LMCacheAsyncLookupClient
from lmcache.v1.rpc_utils import get_zmq_context
from tests.support.pcp_ranks import mla_metadata, valkey_engine_config

endpoint, engine_id, close_bound_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
config = valkey_engine_config("resp://127.0.0.1:9")   # never reached: no lookup is made
config.enable_async_loading = True
metadata = mla_metadata("lookup-close", 1, 0)
metadata.engine_id = engine_id
metadata.role = "scheduler"
# as EngineCore's scheduler makes it for --kv-events-config '{"publisher": "zmq", ...}'
publisher = ZmqEventPublisher(0, endpoint=endpoint, topic="kv-events")
client = LMCacheAsyncLookupClient(config, metadata)

def response_thread_waiting_on_its_socket():
    # The thread's Python frame in process_responses_from_workers sits on the
    # recv() (pristine) or poll() (patched) call while it waits: it is in the loop.
    frame = sys._current_frames().get(client.thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "process_responses_from_workers":
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            return ".recv(" in line or ".poll(" in line
        frame = frame.f_back
    return False

# close() right after the constructor can set running=False before the thread
# reaches its loop; it then exits by itself and close() has nothing to race.
deadline = time.monotonic() + 60
while not response_thread_waiting_on_its_socket():
    if time.monotonic() > deadline:
        sys.exit("the response thread never waited on its socket")
    time.sleep(0.01)
print("response thread waiting on its socket", flush=True)
close_pull_socket = client.pull_socket.close

def closing_pull_socket(*args, **kwargs):
    print(f"closing the pull socket, response thread alive={client.thread.is_alive()}", flush=True)
    return close_pull_socket(*args, **kwargs)

client.pull_socket.close = closing_pull_socket
closing = threading.Thread(target=client.close, daemon=True)
closing.start()
closing.join(close_bound_s)
if closing.is_alive():
    print(f"close() still blocked after {close_bound_s:g} s", flush=True)
    os._exit(3)   # the context's term() cannot be interrupted; the process must not wait on it
print("close() returned", flush=True)
print(f"response thread alive={client.thread.is_alive()}", flush=True)
print(f"shared context closed={get_zmq_context(use_asyncio=False).closed}", flush=True)
publisher.shutdown()
"""


# vLLM's default publisher transport (tcp://*:5557), on loopback and a port the
# kernel picks. An ipc:// path under pytest's tmp_path broke this proof in CI:
# a deep checkout made it longer than sun_path's 107 characters.
PUBLISHER_ENDPOINT = "tcp://127.0.0.1:*"
RACE_SET_UP = "response thread waiting on its socket"


def close_beside_publisher() -> tuple[list[str], str]:
    """The child's lines, and how it ended."""
    from tests.conftest import PATCHES

    cmd = [sys.executable, "-c", CHILD, PUBLISHER_ENDPOINT, f"lookup-close-{uuid.uuid4().hex[:8]}",
           str(CLOSE_BOUND_S)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_BOUND_S, cwd=PATCHES.parent)
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        return out.splitlines(), f"still running after {CHILD_BOUND_S} s"
    last_error = (done.stderr.strip().splitlines() or [""])[-1]
    ended = f"exit {done.returncode}" + (f": {last_error}" if done.returncode and last_error else "")
    return done.stdout.splitlines(), ended


@pytest.mark.fixes(PATCH, fails_with=BLOCKED)
def test_lookup_client_close_returns_beside_vllms_kv_event_publisher():
    lines, ended = close_beside_publisher()
    assert RACE_SET_UP in lines, f"the child never reached close() (child {ended}; it said {lines})"
    assert "close() returned" in lines, (
        f"close() did not return beside vLLM's KV event publisher (child {ended}; it said {lines}): unpatched it "
        "closes its pull socket under the response thread's recv(), which can abort the process in libzmq, then "
        "terminates the process-wide ZMQ context, which waits for the publisher's sockets")
    assert "response thread alive=False" in lines, lines
    assert "shared context closed=False" in lines, f"close() terminated the context the publisher uses: {lines}"
    assert ended == "exit 0", ended


@pytest.mark.fixes(PATCH, fails_with=r"the response thread was still in recv\(\) on it")
def test_lookup_client_close_waits_for_its_response_thread():
    """close() joins the response thread before it closes the thread's socket."""
    lines, ended = close_beside_publisher()
    assert RACE_SET_UP in lines, f"the race was not set up (child {ended}; it said {lines})"
    said = [line for line in lines if line.startswith("closing the pull socket")]
    assert said, f"close() never closed the response socket (child {ended}; it said {lines})"
    assert said == ["closing the pull socket, response thread alive=False"], (
        f"close() closed the pull socket while the response thread was still in recv() on it (a ZMQ socket "
        f"is not thread-safe; child {ended})")
