"""Mooncake traces: one request per JSONL line, by lengths and prefix blocks.

The format of the Mooncake trace release (kvcache-ai/Mooncake, FAST'25)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 49, 50, 51,
     52, 53, 54, 55, 56, 57, 2353, 2354]}

``timestamp`` (number >= 0, required)
    Arrival time in milliseconds; the request is sent at ``timestamp / 1000``
    seconds after the start (the trace's own times, not shifted).
``input_length`` (int >= 1, required)
    Prompt length in tokens.
``output_length`` (int >= 1, required)
    Sent as ``max_tokens``.
``hash_ids`` (list of ints >= 0, required)
    One id per 512-token block of the prompt; equal ids are equal blocks, so
    traces carry their prefix sharing. The prompt text is built from them
    (:mod:`trace_prompts`).

Other keys are ignored. Requests are named ``line<N>``.
"""
from __future__ import annotations

import math
from typing import Any

from .common import OpsError
from .stream import StreamRequest
from .trace_prompts import SyntheticPrompt


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def send_offset_s(obj: dict[str, Any], where: str) -> float:
    """The line's ``timestamp`` (milliseconds) as seconds after the start."""
    if "timestamp" not in obj:
        raise OpsError(f"{where}: missing 'timestamp' (milliseconds after the start to send this request)")
    value = obj["timestamp"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise OpsError(f"{where}: 'timestamp' must be a number of milliseconds >= 0, got {value!r}")
    return value / 1000.0


def token_count(obj: dict[str, Any], key: str, where: str) -> int:
    """A required whole number of tokens >= 1."""
    if key not in obj:
        raise OpsError(f"{where}: missing {key!r}")
    value = obj[key]
    if not _is_whole(value) or value < 1:
        raise OpsError(f"{where}: {key!r} must be a whole number of tokens >= 1, got {value!r}")
    return value


def hash_id_list(obj: dict[str, Any], where: str) -> tuple[int, ...]:
    value = obj.get("hash_ids")
    if not isinstance(value, list) or not all(_is_whole(h) and h >= 0 for h in value):
        raise OpsError(f"{where}: 'hash_ids' must be a list of whole numbers >= 0, got {value!r}")
    return tuple(value)


def parse_mooncake_line(obj: Any, where: str, line_no: int, salt: str = "") -> StreamRequest:
    if not isinstance(obj, dict):
        raise OpsError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    offset = send_offset_s(obj, where)
    input_tokens = token_count(obj, "input_length", where)
    max_tokens = token_count(obj, "output_length", where)
    if "hash_ids" not in obj:
        raise OpsError(f"{where}: missing 'hash_ids' (a Mooncake line has them; without, use --format aiperf)")
    prompt = SyntheticPrompt(input_tokens, hash_id_list(obj, where), own_seed=f"line{line_no}", salt=salt)
    return StreamRequest(id=f"line{line_no}", offset_s=offset, max_tokens=max_tokens, synthetic=prompt)
