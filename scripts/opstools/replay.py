"""Open-loop replay: every request of a stream is sent at its offset by its own task.

A slow server never delays a send: each request waits only for its own
offset, and the HTTP connection pool has no limit. The run stops early when
a stream is malformed (the endpoint does not speak the completions stream
protocol), after ``abort_after_connect_errors`` connection failures in a row
(the endpoint went away), or on SIGINT/SIGTERM; the requests taken so far
keep their records, in-flight ones are marked ``aborted`` and the rest
``not_sent``.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .common import OpsError
from .completions import stream_completion
from .records import CONNECT_ERROR, MALFORMED, RequestRecord
from .stats import Distribution
from .stream import StreamRequest


@dataclass
class ReplayConfig:
    base_url: str
    model: str | None = None
    request_timeout_s: float = 3600.0
    connect_timeout_s: float = 10.0
    abort_after_connect_errors: int = 5
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


async def resolve_model(session: aiohttp.ClientSession, base_url: str, model: str | None, timeout_s: float) -> str:
    """Check the endpoint answers and return the model name to send.

    Without ``model``, the first id of ``GET /v1/models`` is used.
    """
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url) as resp:
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
    if status != 200:
        raise OpsError(f"{url} answered HTTP {status}; pass --model to name the served model")
    try:
        models = [entry["id"] for entry in json.loads(text)["data"]]
    except (ValueError, KeyError, TypeError):
        raise OpsError(f"{url}: not an OpenAI model list; pass --model") from None
    if not models:
        raise OpsError(f"{url}: the server lists no model; pass --model")
    return models[0]


class _RunState:
    def __init__(self, requests_total: int) -> None:
        self.requests_total = requests_total
        self.sent = 0
        self.done = 0
        self.failed = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.connect_errors_in_a_row = 0
        self.abort_reason: str | None = None
        self.interrupted = False
        self.abort_event = asyncio.Event()
        self.recent_ttft: list[float] = []

    def abort(self, reason: str) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
        self.abort_event.set()


async def run_replay(
    requests: list[StreamRequest],
    config: ReplayConfig,
    progress: Callable[[str], None] | None = None,
) -> ReplayResult:
    """Replay ``requests`` (sorted by offset) and return every request's record."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = await resolve_model(session, config.base_url, config.model, config.connect_timeout_s)
        records = [RequestRecord(id=r.id, offset_s=r.offset_s) for r in requests]
        state = _RunState(len(requests))
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        started_epoch = time.time()

        async def send(request: StreamRequest, record: RequestRecord) -> None:
            delay = start + request.offset_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if state.abort_event.is_set():
                return
            body = completion_body(request, model, config.extra_body)
            state.sent += 1
            state.in_flight += 1
            state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
            try:
                await stream_completion(
                    session, config.completions_url, body, record, start, config.request_timeout_s
                )
            finally:
                state.in_flight -= 1
                state.done += 1
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
            else:
                state.connect_errors_in_a_row = 0

        async def report() -> None:
            while True:
                await asyncio.sleep(config.progress_interval_s)
                if progress is None:
                    continue
                recent = Distribution.of(state.recent_ttft)
                state.recent_ttft = []
                ttft = f"TTFT p50 {recent.p50:.2f} s over the last {recent.count}" if recent.count else "no TTFT yet"
                progress(
                    f"[{time.monotonic() - start:7.1f} s] sent {state.sent}/{state.requests_total}"
                    f"  done {state.done}  in flight {state.in_flight}  failed {state.failed}  {ttft}"
                )

        def on_signal(name: str) -> None:
            state.interrupted = True
            state.abort(f"stopped by {name}")

        installed: list[signal.Signals] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal, sig.name)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread (tests) or no signal support

        tasks = [asyncio.create_task(send(r, rec)) for r, rec in zip(requests, records)]
        reporter = asyncio.create_task(report())
        aborter = asyncio.create_task(state.abort_event.wait())
        try:
            everything = asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.wait({everything, aborter}, return_when=asyncio.FIRST_COMPLETED)
            if state.abort_event.is_set():
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            else:
                await everything
        finally:
            reporter.cancel()
            aborter.cancel()
            for sig in installed:
                loop.remove_signal_handler(sig)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]  # a bug here, not a server fault
        return ReplayResult(
            records=records,
            model=model,
            started_epoch_s=started_epoch,
            peak_in_flight=state.peak_in_flight,
            abort_reason=state.abort_reason,
            interrupted=state.interrupted,
        )
