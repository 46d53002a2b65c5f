"""Open-loop replay: every request of a stream is sent at its offset by its own task.

A slow server never delays a send: each request waits only for its own
offset, and the HTTP connection pool has no limit. With ``max_concurrency``
a request that finds that many in flight waits for one to end (its wait is
its client queue time): the run is then closed at that level, no longer open
loop. The run stops early when a stream is malformed (the endpoint does not
speak the completions stream protocol), after ``abort_after_connect_errors``
connection failures in a row (the endpoint went away), after
``abort_after_errors`` failures of the same kind in a row (the endpoint
refuses every request, e.g. HTTP 404 from a wrong path), or on
SIGINT/SIGTERM; the requests taken so far keep their records, in-flight ones
are marked ``aborted`` and the rest ``not_sent``.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from .common import OpsError
from .completions import stream_completion
from .records import CONNECT_ERROR, DISCONNECTED, HTTP_ERROR, MALFORMED, NO_TOKEN, STREAM_ERROR, RequestRecord
from .stats import Distribution
from .stream import StreamRequest


# a request's body (and a trace line's prompt text) is built this long before its send time
PREPARE_AHEAD_S = 0.5


def base_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be an engine's base URL, or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"--url {url}: expected the engine's base URL, e.g. http://127.0.0.1:8000"
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        base = f"{parts.scheme}://{parts.netloc}{path[: -len('/v1')]}"
        return (f"--url {url} ends in /v1: give the server's base URL ({base}); replay adds "
                "/v1/completions and /v1/models itself")
    return None


@dataclass
class ReplayConfig:
    base_url: str
    model: str | None = None
    request_timeout_s: float = 3600.0
    connect_timeout_s: float = 10.0
    abort_after_connect_errors: int = 5
    abort_after_errors: int | None = 20  # failures of one kind in a row; None never stops
    max_concurrency: int | None = None  # None: open loop
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress_interval_s: float = 5.0

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/completions"


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    model: str
    started_epoch_s: float
    peak_in_flight: int
    abort_reason: str | None = None  # set when the run stopped early
    interrupted: bool = False


def completion_body(request: StreamRequest, model: str, extra_body: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.completion_prompt(),
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra_body)
    return body


async def resolve_model(http: aiohttp.ClientSession, base_url: str, model: str | None, timeout_s: float) -> str:
    """Check the endpoint answers and return the model name to send.

    Without ``model``, the first id of ``GET /v1/models`` is used.
    """
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with asyncio.timeout(timeout_s):
            async with http.get(url) as resp:
                status = resp.status
                text = await resp.text(errors="replace")
    except aiohttp.ClientConnectorError as exc:
        reason = exc.os_error.strerror if exc.os_error is not None else None
        raise OpsError(f"cannot connect to {base_url}: {reason or exc} (is the engine up?)") from None
    except TimeoutError:
        raise OpsError(f"{url}: no answer within {timeout_s:g} s") from None
    except aiohttp.ClientError as exc:
        raise OpsError(f"{url}: {exc!r}") from None
    if model:
        return model
    if status == 404:
        raise OpsError(f"{url} answered HTTP 404; pass --model NAME if this is a front end without GET "
                       "/v1/models (vLLM's P/D toy proxy), else check that --url is the server's base URL")
    if status != 200:
        raise OpsError(f"{url} answered HTTP {status}; pass --model to name the served model")
    try:
        models = [entry["id"] for entry in json.loads(text)["data"]]
    except (ValueError, KeyError, TypeError):
        raise OpsError(f"{url}: not an OpenAI model list; pass --model") from None
    if not models:
        raise OpsError(f"{url}: the server lists no model; pass --model")
    return models[0]


def failure_kind(record: RequestRecord) -> str | None:
    """What a failure that counts toward ``abort_after_errors`` is, e.g. ``HTTP 404``; None otherwise."""
    if record.status == HTTP_ERROR:
        return f"HTTP {record.http_status}"
    if record.status == STREAM_ERROR:
        return "a server error event"
    if record.status == NO_TOKEN:
        return "a stream without a token"
    if record.status == DISCONNECTED:
        return "a broken connection"
    return None


def _repeated_failure_hint(kind: str, completions_url: str) -> str:
    if kind in ("HTTP 404", "HTTP 405"):
        return (f"; nothing answers POST {completions_url}: --url must be the server's base URL, "
                "replay adds /v1/completions")
    return ""


class _RunState:
    def __init__(self, requests_total: int) -> None:
        self.requests_total = requests_total
        self.sent = 0
        self.done = 0
        self.failed = 0
        self.in_flight = 0
        self.queued = 0
        self.peak_in_flight = 0
        self.connect_errors_in_a_row = 0
        self.failure_kind: str | None = None
        self.same_failures_in_a_row = 0
        self.abort_reason: str | None = None
        self.interrupted = False
        self.abort_event = asyncio.Event()
        self.recent_ttft: list[float] = []

    def abort(self, reason: str) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
        self.abort_event.set()

    def stop_by_signal(self, name: str) -> None:
        self.interrupted = True
        self.abort(f"stopped by {name}")

    def count_failure(self, kind: str | None) -> int:
        """Track failures of one kind in a row; returns how many in a row ``kind`` has now."""
        if kind is None:
            self.failure_kind, self.same_failures_in_a_row = None, 0
        elif kind == self.failure_kind:
            self.same_failures_in_a_row += 1
        else:
            self.failure_kind, self.same_failures_in_a_row = kind, 1
        return self.same_failures_in_a_row


async def _sleep_until(moment: float) -> None:
    delay = moment - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


class _Replay:
    """One run's shared parts: the HTTP client, the model, the clock, the counters and the client slots."""

    def __init__(self, http: aiohttp.ClientSession, config: ReplayConfig, model: str, requests_total: int,
                 progress: Callable[[str], None] | None) -> None:
        self.http = http
        self.config = config
        self.model = model
        self.progress = progress
        self.state = _RunState(requests_total)
        self.start = time.monotonic()
        self.started_epoch = time.time()
        self.slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    async def run(self, requests: list[StreamRequest], records: list[RequestRecord]) -> None:
        """Send every request by its own task; stop them all when the run aborts."""
        loop = asyncio.get_running_loop()
        installed = _install_signal_handlers(loop, self.state.stop_by_signal)
        tasks = [asyncio.create_task(self.send_one(r, rec)) for r, rec in zip(requests, records)]
        reporter = asyncio.create_task(self.report())
        aborter = asyncio.create_task(self.state.abort_event.wait())
        try:
            await _all_done_or_aborted(tasks, aborter, self.state)
        finally:
            reporter.cancel()
            aborter.cancel()
            for sig in installed:
                loop.remove_signal_handler(sig)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]  # a bug here, not a server fault

    async def send_one(self, request: StreamRequest, record: RequestRecord) -> None:
        await _sleep_until(self.start + request.offset_s - PREPARE_AHEAD_S)
        if self.state.abort_event.is_set():
            return
        body = completion_body(request, self.model, self.config.extra_body)
        await _sleep_until(self.start + request.offset_s)
        if self.state.abort_event.is_set():
            return
        if self.slots is None:
            await self.exchange(body, record)
            return
        await self.take_slot(self.slots, record)
        try:
            await self.exchange(body, record)
        finally:
            self.slots.release()

    async def take_slot(self, slots: asyncio.Semaphore, record: RequestRecord) -> None:
        """Wait for a free client slot; the wait is the request's client queue time."""
        self.state.queued += 1
        waiting_since = time.monotonic()
        try:
            await slots.acquire()
        finally:
            self.state.queued -= 1
        record.client_queue_s = time.monotonic() - waiting_since

    async def exchange(self, body: dict[str, Any], record: RequestRecord) -> None:
        state = self.state
        state.sent += 1
        state.in_flight += 1
        state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
        try:
            await stream_completion(
                self.http, self.config.completions_url, body, record, self.start, self.config.request_timeout_s
            )
        finally:
            state.in_flight -= 1
            state.done += 1
        self.judge(record)

    def judge(self, record: RequestRecord) -> None:
        """Count the request's outcome and abort the run on a malformed stream or too many failures in a row."""
        state, config = self.state, self.config
        if not record.ok:
            state.failed += 1
        elif record.ttft_s is not None:
            state.recent_ttft.append(record.ttft_s)
        if record.status == MALFORMED:
            state.abort(f"request {record.id}: {record.error}")
        elif record.status == CONNECT_ERROR:
            state.connect_errors_in_a_row += 1
            if state.connect_errors_in_a_row >= config.abort_after_connect_errors:
                state.abort(
                    f"{state.connect_errors_in_a_row} connection failures in a row, "
                    f"the endpoint stopped answering: {record.error}"
                )
            return
        else:
            state.connect_errors_in_a_row = 0
        kind = failure_kind(record)
        in_a_row = state.count_failure(kind)
        if kind is not None and config.abort_after_errors is not None and in_a_row >= config.abort_after_errors:
            state.abort(f"{in_a_row} requests in a row failed with {kind} (last: {record.error})"
                        + _repeated_failure_hint(kind, config.completions_url))

    async def report(self) -> None:
        while True:
            await asyncio.sleep(self.config.progress_interval_s)
            if self.progress is None:
                continue
            self.progress(self.progress_line())

    def progress_line(self) -> str:
        """The counters since the start and the TTFT of the requests done since the last line."""
        state = self.state
        recent = Distribution.of(state.recent_ttft)
        state.recent_ttft = []
        ttft = f"TTFT p50 {recent.p50:.2f} s over the last {recent.count}" if recent.count else "no TTFT yet"
        queued = f"  queued {state.queued}" if self.slots is not None else ""
        return (
            f"[{time.monotonic() - self.start:7.1f} s] sent {state.sent}/{state.requests_total}"
            f"  done {state.done}  in flight {state.in_flight}{queued}  failed {state.failed}  {ttft}"
        )


def _install_signal_handlers(loop: asyncio.AbstractEventLoop, on_signal: Callable[[str], None]) -> list[signal.Signals]:
    """``on_signal(name)`` on SIGINT and SIGTERM where this thread can take them; the signals installed."""
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig.name)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (tests) or no signal support
    return installed


async def _all_done_or_aborted(tasks: list[asyncio.Task[None]], aborter: asyncio.Task[Any], state: _RunState) -> None:
    """Wait for every send task, or, once the run aborts, cancel those left and wait for them to end."""
    everything = asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.wait({everything, aborter}, return_when=asyncio.FIRST_COMPLETED)
    if state.abort_event.is_set():
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    else:
        await everything


async def run_replay(
    requests: list[StreamRequest],
    config: ReplayConfig,
    progress: Callable[[str], None] | None = None,
) -> ReplayResult:
    """Replay ``requests`` (sorted by offset) and return every request's record."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        model = await resolve_model(http, config.base_url, config.model, config.connect_timeout_s)
        records = [RequestRecord(id=r.id, offset_s=r.offset_s) for r in requests]
        replay = _Replay(http, config, model, len(requests), progress)
        await replay.run(requests, records)
        return ReplayResult(
            records=records,
            model=model,
            started_epoch_s=replay.started_epoch,
            peak_in_flight=replay.state.peak_in_flight,
            abort_reason=replay.state.abort_reason,
            interrupted=replay.state.interrupted,
        )
