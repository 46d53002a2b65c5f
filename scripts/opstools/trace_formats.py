"""Which request file format a path holds, and reading it into :class:`StreamRequest` s.

Formats: ``stream`` (replay's own, :mod:`stream`), ``mooncake``
(:mod:`trace_mooncake`), ``aiperf`` (AIPerf's fixed schedule,
:mod:`trace_aiperf`). ``auto`` looks at the first line: ``offset_s`` is a
stream; ``timestamp`` is a trace, read as Mooncake when the line has
``input_length``, ``output_length`` and ``hash_ids``, else as AIPerf.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import OpsError
from .stream import StreamRequest, read_jsonl_objects, read_stream
from .trace_aiperf import TEXT_KEYS, parse_aiperf_line
from .trace_mooncake import parse_mooncake_line

FORMATS = ("auto", "stream", "mooncake", "aiperf")
MOONCAKE_KEYS = ("input_length", "output_length", "hash_ids")


def detect_format(obj: Any, where: str) -> str:
    if isinstance(obj, dict):
        if "offset_s" in obj:
            return "stream"
        if "timestamp" in obj:
            if all(key in obj for key in MOONCAKE_KEYS) and not any(key in obj for key in TEXT_KEYS):
                return "mooncake"
            return "aiperf"
    raise OpsError(f"{where}: cannot tell the format (a line with 'offset_s' is a replay stream, one with "
                   "'timestamp' a trace); pass --format")


def _first_object(path: Path) -> tuple[int, Any]:
    for line_no, obj in read_jsonl_objects(path, "requests"):
        return line_no, obj
    raise OpsError(f"requests {path}: no requests in it")


def read_requests(path: Path, fmt: str = "auto", salt: str = "",
                  default_max_tokens: int | None = None) -> tuple[list[StreamRequest], str]:
    """The requests of ``path`` sorted by send time, and the format they were read as."""
    if fmt == "auto":
        line_no, obj = _first_object(path)
        fmt = detect_format(obj, f"{path}:{line_no}")
    if fmt == "stream":
        return read_stream(path), fmt
    if fmt not in FORMATS:
        raise OpsError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    requests: list[StreamRequest] = []
    for line_no, obj in read_jsonl_objects(path, "trace"):
        where = f"{path}:{line_no}"
        if fmt == "mooncake":
            requests.append(parse_mooncake_line(obj, where, line_no, salt))
        else:
            requests.append(parse_aiperf_line(obj, where, line_no, salt, default_max_tokens))
    if not requests:
        raise OpsError(f"trace {path}: no requests in it")
    requests.sort(key=lambda r: r.offset_s)
    return requests, fmt
