"""One replayed request's outcome (no third-party imports, so reports load anywhere).

Statuses:

- ``ok``: a complete stream ending in ``[DONE]``;
- ``http_error``: a status other than 200;
- ``stream_error``: the server streamed an ``{"error": ...}`` event;
- ``malformed_stream``: not an event stream, an event that is not JSON or has
  neither ``choices`` nor ``error``, or no ``[DONE]`` before the end;
- ``no_token``: a complete stream without any ``choices`` event (no token
  came, so there is no TTFT; ``vllm bench serve`` fails such a request too);
- ``connect_error``: no connection could be made;
- ``disconnected``: the connection broke during the response;
- ``timeout``: no complete answer within the request timeout;
- ``aborted``: the replay stopped while the request was in flight;
- ``not_sent``: the replay stopped before the request's send time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

OK = "ok"
HTTP_ERROR = "http_error"
STREAM_ERROR = "stream_error"
MALFORMED = "malformed_stream"
NO_TOKEN = "no_token"
CONNECT_ERROR = "connect_error"
DISCONNECTED = "disconnected"
TIMEOUT = "timeout"
ABORTED = "aborted"
NOT_SENT = "not_sent"


@dataclass
class RequestRecord:
    id: str
    offset_s: float
    sent_s: float | None = None  # seconds after the run's start
    # seconds the request waited for a free slot under --max-concurrency (None without a limit)
    client_queue_s: float | None = None
    sent_epoch_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_source: str = ""  # "usage" or "chunks"
    cached_tokens: int | None = None
    text_chunks: int = 0  # choices events with non-empty text
    choice_events: int = 0  # events with a non-empty choices list (one per token or batch of tokens)
    # arrival times (seconds after the run's start) of every choices event after the first
    token_times_s: list[float] = field(default_factory=list, repr=False)
    status: str = NOT_SENT
    http_status: int | None = None
    error: str = ""
    text: str = field(default="", repr=False)

    @property
    def ttft_s(self) -> float | None:
        if self.sent_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        if self.sent_s is None or self.end_s is None:
            return None
        return self.end_s - self.sent_s

    @property
    def send_lag_s(self) -> float | None:
        """How late the client sent the request, not counting a wait for a concurrency slot."""
        if self.sent_s is None:
            return None
        return self.sent_s - self.offset_s - (self.client_queue_s or 0.0)

    @property
    def ok(self) -> bool:
        return self.status == OK
