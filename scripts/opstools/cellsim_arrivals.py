"""The simulator's requests: a Poisson stream, or a trace with its original send times.

A trace is JSONL, one request per line (blank lines ignored), the replay
stream's format (``scripts/replay generate`` writes it) or just the fields the
simulator reads::

    {"id": "r00000", "offset_s": 0.0, "prompt": "...", "max_tokens": 1, "approx_prompt_tokens": 16402}
    {"offset_s": 0.84, "prompt_tokens": 16384, "hit_tokens": 16128}

``offset_s`` (number >= 0, required): the send time, seconds after the start.
The prompt length is ``prompt_tokens``, else the length of
``prompt_token_ids``, else ``approx_prompt_tokens``; a line with only a
``prompt`` text gets the default length. ``hit_tokens`` (optional, 0 to the
prompt length): the prefix in L2, cut to whole chunks; without it, the
default hit fraction of the prompt. Other keys are ignored.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import OpsError

LENGTH_KEYS = ("prompt_tokens", "prompt_token_ids", "approx_prompt_tokens")


@dataclass(frozen=True)
class Arrival:
    arrival_s: float
    prompt_tokens: int
    hit_tokens: int  # whole chunks in L2 (0: a miss)


def whole_chunks(tokens: float, chunk_tokens: int) -> int:
    return math.floor(tokens / chunk_tokens) * chunk_tokens


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """A length between ``low`` and ``high``, uniform in its logarithm (the replay generator's default)."""
    if low == high:
        return low
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def poisson_arrivals(count: int, rate_per_s: float, prompt_tokens: int | tuple[int, int], hit_fraction: float,
                     chunk_tokens: int, seed: int, miss_share: float = 0.0) -> list[Arrival]:
    """``count`` Poisson arrivals of ``prompt_tokens`` (or a length between the two ends, log-uniform) with
    the whole chunks of ``hit_fraction`` of each in L2, except a ``miss_share`` of them that find nothing."""
    rng = random.Random(seed)
    arrivals = []
    now = 0.0
    for index in range(count):
        if index:
            now += rng.expovariate(rate_per_s)
        tokens = prompt_tokens if isinstance(prompt_tokens, int) else log_uniform(rng, *prompt_tokens)
        missed = miss_share > 0 and rng.random() < miss_share
        arrivals.append(Arrival(now, tokens, 0 if missed else whole_chunks(tokens * hit_fraction, chunk_tokens)))
    return arrivals


def _count(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    return None


def _prompt_tokens(obj: dict[str, Any], where: str, default_tokens: int) -> int:
    for key in LENGTH_KEYS:
        if key not in obj:
            continue
        value = obj[key]
        tokens = len(value) if key == "prompt_token_ids" and isinstance(value, list) else _count(value)
        if tokens is None or tokens < 1:
            raise OpsError(f"{where}: '{key}' must give a prompt length >= 1 token, got {value!r}")
        return tokens
    if "prompt" in obj:
        return default_tokens
    raise OpsError(f"{where}: no prompt length: give one of {', '.join(LENGTH_KEYS)}")


def parse_trace_line(obj: Any, where: str, default_tokens: int, hit_fraction: float, chunk_tokens: int) -> Arrival:
    if not isinstance(obj, dict):
        raise OpsError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    offset = obj.get("offset_s")
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset) or offset < 0:
        raise OpsError(f"{where}: 'offset_s' must be a number >= 0 (the send time), got {offset!r}")
    tokens = _prompt_tokens(obj, where, default_tokens)
    if "hit_tokens" in obj:
        hit = _count(obj["hit_tokens"])
        if hit is None or not 0 <= hit <= tokens:
            raise OpsError(f"{where}: 'hit_tokens' must be a whole number from 0 to the prompt's {tokens}, "
                           f"got {obj['hit_tokens']!r}")
    else:
        hit = tokens * hit_fraction
    return Arrival(float(offset), tokens, whole_chunks(hit, chunk_tokens))


def read_trace(path: Path, default_tokens: int, hit_fraction: float, chunk_tokens: int) -> list[Arrival]:
    """Every request of the trace at ``path``, sorted by send time; OpsError names the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise OpsError(f"trace {path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise OpsError(f"trace {path}: not UTF-8 text ({exc.reason})") from None
    arrivals = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise OpsError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        arrivals.append(parse_trace_line(obj, where, default_tokens, hit_fraction, chunk_tokens))
    if not arrivals:
        raise OpsError(f"trace {path}: no requests in it")
    return sorted(arrivals, key=lambda a: a.arrival_s)
