"""The replay request stream: a JSONL file, one request per line.

Format (UTF-8, one JSON object per line, blank lines ignored)::

    {"id": "r0001", "offset_s": 0.0,  "prompt": "some text ...", "max_tokens": 64}
    {"id": "r0002", "offset_s": 0.84, "prompt_token_ids": [151331, 892, 17], "max_tokens": 1}

Fields:

``offset_s`` (number >= 0, required)
    When to send the request, in seconds after the replay starts. The replay
    sends every request at its offset whatever the server is doing (open loop);
    lines need not be sorted.
``prompt`` (string) or ``prompt_token_ids`` (list of ints >= 0), exactly one
    The completion prompt. Token ids are sent as the ``prompt`` of
    ``/v1/completions``, which vLLM accepts as pre-tokenized input.
``max_tokens`` (int >= 1, required)
    Passed through to the server.
``id`` (string, optional)
    A name for the request in the CSV and in error messages; default
    ``line<N>``. Ids must be unique.

Any other key is ignored (the generator adds ``approx_prompt_tokens`` and
``reuses`` for reference), so production logs can carry their own fields.

Traces in other formats (Mooncake, AIPerf's fixed schedule) are read by the
``trace_*`` modules into the same :class:`StreamRequest`.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from .common import OpsError
from .trace_prompts import SyntheticPrompt


@dataclass(frozen=True)
class StreamRequest:
    id: str
    offset_s: float
    max_tokens: int
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    synthetic: SyntheticPrompt | None = None  # a trace line's lengths and hash ids, built at send time

    def completion_prompt(self) -> str | list[int]:
        if self.prompt is not None:
            return self.prompt
        if self.synthetic is not None:
            return self.synthetic.text()
        assert self.prompt_token_ids is not None
        return list(self.prompt_token_ids)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_request(obj: Any, where: str, default_id: str) -> StreamRequest:
    """Validate one decoded line; ``where`` (``file:line``) prefixes every error."""
    if not isinstance(obj, dict):
        raise OpsError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    offset = obj.get("offset_s")
    if offset is None:
        hint = "; a trace line? pass --format mooncake or --format aiperf" if "timestamp" in obj else ""
        raise OpsError(f"{where}: missing 'offset_s' (seconds after the start to send this request){hint}")
    if not _is_number(offset) or offset < 0:
        raise OpsError(f"{where}: 'offset_s' must be a number >= 0, got {offset!r}")
    max_tokens = obj.get("max_tokens")
    if max_tokens is None:
        raise OpsError(f"{where}: missing 'max_tokens'")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise OpsError(f"{where}: 'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    has_prompt = "prompt" in obj
    has_ids = "prompt_token_ids" in obj
    if has_prompt == has_ids:
        raise OpsError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    if has_prompt:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise OpsError(f"{where}: 'prompt' must be a non-empty string")
    else:
        ids = obj["prompt_token_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise OpsError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers >= 0")
        token_ids = tuple(ids)
    request_id = obj.get("id", default_id)
    if not isinstance(request_id, str) or not request_id:
        raise OpsError(f"{where}: 'id' must be a non-empty string, got {request_id!r}")
    return StreamRequest(
        id=request_id,
        offset_s=float(offset),
        max_tokens=max_tokens,
        prompt=prompt,
        prompt_token_ids=token_ids,
    )


def read_jsonl_objects(path: Path, what: str) -> Iterator[tuple[int, Any]]:
    """``(line number, decoded JSON)`` of every non-blank line of a UTF-8 JSONL file.

    ``what`` names the file in errors (``stream``, ``trace``); a line that is
    not JSON is named by file and line.
    """
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise OpsError(f"{what} {path}: cannot open: {exc.strerror or exc}") from exc
    with handle:
        try:
            for line_no, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise OpsError(f"{path}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                yield line_no, obj
        except UnicodeDecodeError as exc:
            raise OpsError(f"{what} {path}: not UTF-8 text ({exc.reason})") from None


def read_stream(path: Path) -> list[StreamRequest]:
    """Read and validate a stream file; the result is sorted by offset (stable)."""
    requests: list[StreamRequest] = []
    seen: dict[str, int] = {}
    for line_no, obj in read_jsonl_objects(path, "stream"):
        where = f"{path}:{line_no}"
        request = parse_request(obj, where, default_id=f"line{line_no}")
        if request.id in seen:
            raise OpsError(f"{where}: id {request.id!r} already used on line {seen[request.id]}")
        seen[request.id] = line_no
        requests.append(request)
    if not requests:
        raise OpsError(f"stream {path}: no requests in it")
    requests.sort(key=lambda r: r.offset_s)
    return requests


def mean_rate(offsets: Sequence[float]) -> float:
    """Arrivals per second between the first and the last send time (inf when they are equal)."""
    if len(offsets) < 2:
        return math.inf
    span = max(offsets) - min(offsets)
    return (len(offsets) - 1) / span if span > 0 else math.inf


def at_rate(requests: Sequence[StreamRequest], rate: float) -> list[StreamRequest]:
    """The requests with their gaps scaled so the mean arrival rate is ``rate`` (inf: all at the first offset).

    The pattern of the arrivals (bursts, lulls) is kept; only time is stretched or squeezed.
    """
    first = min(r.offset_s for r in requests)
    if math.isinf(rate):
        return [replace(r, offset_s=first) for r in requests]
    native = mean_rate([r.offset_s for r in requests])
    if math.isinf(native):
        raise OpsError("--request-rate: the stream sends everything at one time, so it has no rate to scale; "
                       "it needs two or more distinct send times")
    factor = native / rate
    return [replace(r, offset_s=first + (r.offset_s - first) * factor) for r in requests]


def request_to_json(request: StreamRequest, extra: dict[str, Any] | None = None) -> str:
    obj: dict[str, Any] = {"id": request.id, "offset_s": round(request.offset_s, 6)}
    if request.prompt_token_ids is not None:
        obj["prompt_token_ids"] = list(request.prompt_token_ids)
    else:
        obj["prompt"] = request.completion_prompt()
    obj["max_tokens"] = request.max_tokens
    if extra:
        obj.update(extra)
    return json.dumps(obj, ensure_ascii=False)


def write_stream(handle: TextIO, requests: Iterable[tuple[StreamRequest, dict[str, Any]]]) -> int:
    """Write ``(request, extra fields)`` pairs as JSONL; returns the count."""
    count = 0
    for request, extra in requests:
        handle.write(request_to_json(request, extra))
        handle.write("\n")
        count += 1
    return count

