"""One streamed ``/v1/completions`` request, timed: TTFT, end-to-end, tokens, status.

The answer to a ``stream: true`` request is read as an event stream
(``data: {json}`` events and a final ``data: [DONE]``, the OpenAI and vLLM
format) whatever its Content-Type says: front ends such as vLLM's P/D toy
proxy relay the engine's stream as ``application/json``. A wrong header is
reported once per endpoint and Content-Type (on stderr); a body with no event
in it is still a malformed stream.

Timing follows ``vllm bench serve``: TTFT is the time from sending the request
to the first event with a non-empty ``choices`` list, whatever its text (a
token can detokenize to ``""``, as happens with prefill-only ``max_tokens: 1``
requests); each later ``choices`` event adds one inter-token latency. A
complete stream without any ``choices`` event is a failure (``no_token``).
Tokens come from the ``usage`` event (``stream_options.include_usage``) when
the server sends one, else from the number of ``choices`` events.

Outcomes: the statuses of :mod:`records`.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import aiohttp

from .records import (
    ABORTED,
    CONNECT_ERROR,
    DISCONNECTED,
    HTTP_ERROR,
    MALFORMED,
    NO_TOKEN,
    OK,
    STREAM_ERROR,
    TIMEOUT,
    RequestRecord,
)


class StreamProtocolError(Exception):
    """The response is not an OpenAI completions event stream."""


_warned_headers: set[tuple[str, str]] = set()


def _warn_content_type(url: str, content_type: str) -> None:
    """Say once per endpoint and header that a stream came with a wrong Content-Type."""
    key = (url, content_type)
    if key in _warned_headers:
        return
    _warned_headers.add(key)
    print(f"warning: {url} answered a stream: true request with Content-Type {content_type or 'none'!r}, "
          "not text/event-stream; reading it as an event stream (vLLM's P/D toy proxy does this)",
          file=sys.stderr, flush=True)


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _EventAssembler:
    """Splits a byte stream into SSE events and yields each event's data."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data_lines: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                break
            raw, self._buffer = self._buffer[:newline], self._buffer[newline + 1 :]
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if not line:
                if self._data_lines:
                    events.append("\n".join(self._data_lines))
                    self._data_lines = []
                continue
            if line.startswith(":"):
                continue  # an SSE comment (keep-alive)
            name, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._data_lines.append(value)
            # other fields (event:, id:, retry:) carry nothing for completions
        return events

    def finish(self) -> list[str]:
        events = self.feed(b"\n\n") if self._buffer else []
        if self._data_lines:
            events.append("\n".join(self._data_lines))
            self._data_lines = []
        return events


def _handle_event(data: str, record: RequestRecord, now_s: float, keep_text: bool) -> bool:
    """Apply one event to the record; returns True at ``[DONE]``."""
    if data.strip() == "[DONE]":
        return True
    try:
        payload = json.loads(data)
    except json.JSONDecodeError:
        raise StreamProtocolError(f"event is not JSON: {_short(data, 120)!r}") from None
    if not isinstance(payload, dict):
        raise StreamProtocolError(f"event is not a JSON object: {_short(data, 120)!r}")
    if "error" in payload:
        error = payload["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        record.status = STREAM_ERROR
        record.error = _short(f"server error event: {message}")
        return False
    choices = payload.get("choices")
    usage = payload.get("usage")
    if choices is None and usage is None:
        raise StreamProtocolError(f"event has neither 'choices' nor 'error': {_short(data, 120)!r}")
    if isinstance(choices, list) and choices:
        if record.first_token_s is None:
            record.first_token_s = now_s
        else:
            record.token_times_s.append(now_s)
        record.choice_events += 1
        for choice in choices:
            text = choice.get("text") if isinstance(choice, dict) else None
            if text is None and isinstance(choice, dict):
                delta = choice.get("delta")  # chat-style chunks, for endpoints that send them
                text = delta.get("content") if isinstance(delta, dict) else None
            if text:
                record.text_chunks += 1
                if keep_text:
                    record.text += text
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            record.completion_tokens = usage["completion_tokens"]
            record.tokens_source = "usage"
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]
    return False


async def stream_completion(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    start_monotonic: float,
    request_timeout_s: float,
    keep_text: bool = False,
) -> None:
    """Send one streaming request and fill ``record``; never raises for server faults.

    Times are seconds after ``start_monotonic`` (``time.monotonic()`` base).
    Cancellation marks the record ``aborted`` and is re-raised.
    """

    def now() -> float:
        return time.monotonic() - start_monotonic

    payload = json.dumps(body).encode()
    record.sent_s = now()
    record.sent_epoch_s = time.time()
    done = False
    try:
        async with asyncio.timeout(request_timeout_s):
            async with http.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
                record.http_status = resp.status
                if resp.status != 200:
                    text = await resp.text(errors="replace")
                    record.status = HTTP_ERROR
                    record.error = _short(f"HTTP {resp.status}: {text}")
                    return
                content_type = resp.headers.get("Content-Type", "")
                if not content_type.startswith("text/event-stream"):
                    if not body.get("stream"):
                        raise StreamProtocolError(
                            f"expected Content-Type text/event-stream, got {content_type or 'none'!r}"
                        )
                    _warn_content_type(url, content_type)
                assembler = _EventAssembler()
                events = 0
                head = b""
                async for chunk in resp.content.iter_any():
                    if len(head) < 120:
                        head += chunk[: 120 - len(head)]
                    for data in assembler.feed(chunk):
                        events += 1
                        done = _handle_event(data, record, now(), keep_text) or done
                for data in assembler.finish():
                    events += 1
                    done = _handle_event(data, record, now(), keep_text) or done
        record.end_s = now()
        if record.status == STREAM_ERROR:
            return
        if not events:
            raise StreamProtocolError(
                f"the body holds no 'data:' event (Content-Type {content_type or 'none'!r}, "
                f"begins {_short(head.decode('utf-8', errors='replace'), 80)!r}): not an event stream"
            )
        if not done:
            raise StreamProtocolError("the stream ended without 'data: [DONE]'")
        if record.completion_tokens is None:
            record.completion_tokens = record.choice_events
            record.tokens_source = "chunks"
        if record.first_token_s is None:
            record.status = NO_TOKEN
            record.error = "the stream ended without any 'choices' event: no token, TTFT not measured"
            return
        record.status = OK
    except StreamProtocolError as exc:
        record.end_s = now()
        record.status = MALFORMED
        record.error = f"malformed stream: {exc}"
    except aiohttp.ClientConnectorError as exc:
        record.end_s = now()
        record.status = CONNECT_ERROR
        record.error = _short(f"cannot connect to {url}: {exc.os_error.strerror or exc}")
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as exc:
        record.end_s = now()
        record.status = DISCONNECTED
        record.error = _short(f"connection broke during the response: {exc!r}")
    except TimeoutError:
        record.end_s = now()
        record.status = TIMEOUT
        record.error = f"no complete answer within {request_timeout_s:g} s"
    except aiohttp.ClientError as exc:
        record.end_s = now()
        record.status = DISCONNECTED
        record.error = _short(f"HTTP client error: {exc!r}")
    except asyncio.CancelledError:
        record.end_s = now()
        record.status = ABORTED
        record.error = "the replay stopped while this request was in flight"
        raise
