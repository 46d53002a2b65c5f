"""AIPerf's fixed-schedule traces: JSONL lines sent at their ``timestamp``.

AIPerf (``aiperf profile --custom-dataset-type mooncake_trace
--fixed-schedule``) reads the Mooncake line and more::

    {"timestamp": 0, "input_length": 100, "output_length": 200, "hash_ids": [1001]}
    {"timestamp": 500, "text_input": "Summarize ...", "output_length": 64}

``timestamp`` (number >= 0, milliseconds, required)
    Send time, kept as in the trace.
``input_length`` (int >= 1) or the prompt text, exactly one
    The text may be under ``text_input``, ``input_text`` or ``text`` (AIPerf's
    mooncake and single-turn spellings); a text is sent as written.
``hash_ids`` (list of ints >= 0, optional, only with ``input_length``)
    512-token prefix blocks, as in a Mooncake trace; without them the prompt
    shares nothing with other requests.
``output_length`` (int >= 1, optional)
    Sent as ``max_tokens``; a line without it takes ``--default-max-tokens``.

Keys that would change what is sent and that replay cannot honour
(``messages``, ``payload``, ``tools``, ``extra``, ``delay``, ``texts``) are
errors; any other key (``session_id``, ...) is ignored.
"""
from __future__ import annotations

from typing import Any

from .common import OpsError
from .stream import StreamRequest
from .trace_mooncake import hash_id_list, send_offset_s, token_count
from .trace_prompts import SyntheticPrompt

TEXT_KEYS = ("text_input", "input_text", "text")
UNSUPPORTED_KEYS = {
    "messages": "chat messages (replay sends /v1/completions prompts)",
    "payload": "a verbatim request payload",
    "tools": "tool definitions",
    "extra": "per-request body fields",
    "delay": "a delay after the previous turn (give 'timestamp')",
    "texts": "a list of texts (give one 'text')",
}


def _max_tokens(obj: dict[str, Any], where: str, default_max_tokens: int | None) -> int:
    if "output_length" in obj:
        return token_count(obj, "output_length", where)
    if default_max_tokens is None:
        raise OpsError(f"{where}: no 'output_length'; pass --default-max-tokens N for lines without one")
    return default_max_tokens


def parse_aiperf_line(obj: Any, where: str, line_no: int, salt: str = "",
                      default_max_tokens: int | None = None) -> StreamRequest:
    if not isinstance(obj, dict):
        raise OpsError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key, what in UNSUPPORTED_KEYS.items():
        if key in obj:
            raise OpsError(f"{where}: {key!r} ({what}) is not supported by replay")
    offset = send_offset_s(obj, where)
    max_tokens = _max_tokens(obj, where, default_max_tokens)
    texts = [key for key in TEXT_KEYS if key in obj]
    given = texts + (["input_length"] if "input_length" in obj else [])
    if len(given) != 1:
        raise OpsError(f"{where}: give exactly one of 'input_length', {', '.join(repr(k) for k in TEXT_KEYS)}"
                       + (f" (the line has {', '.join(given)})" if given else ""))
    request_id = f"line{line_no}"
    if texts:
        if "hash_ids" in obj:
            raise OpsError(f"{where}: 'hash_ids' only go with 'input_length', not with a prompt text")
        text = obj[texts[0]]
        if not isinstance(text, str) or not text:
            raise OpsError(f"{where}: {texts[0]!r} must be a non-empty string")
        return StreamRequest(id=request_id, offset_s=offset, max_tokens=max_tokens, prompt=text)
    input_tokens = token_count(obj, "input_length", where)
    hash_ids = hash_id_list(obj, where) if "hash_ids" in obj else ()
    prompt = SyntheticPrompt(input_tokens, hash_ids, own_seed=request_id, salt=salt)
    return StreamRequest(id=request_id, offset_s=offset, max_tokens=max_tokens, synthetic=prompt)
