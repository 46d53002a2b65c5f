"""Evidence that a KV cache tier served a prompt: vLLM's connector hit counter, or usage.

Two sources, both as vLLM 0.31.0 exposes them:

- ``/metrics``: the counter ``vllm:external_prefix_cache_hits`` (exposed by the
  Prometheus client as ``vllm:external_prefix_cache_hits_total``), the prompt
  tokens that the KV connector (LMCache) found, one sample per engine and
  model; the delta over one request, summed over every given engine, is what
  the connector served. This is the evidence through a P/D front end: the
  prefill engines' counters (the decode engine counts NIXL's transfer too).
- ``usage.prompt_tokens_details.cached_tokens`` of the answer, which vLLM sends
  only with ``--enable-prompt-tokens-details``. It counts vLLM's own GPU prefix
  cache as well as the connector, so it is used only where no counter can be
  read. Through a P/D proxy it is the prefill engine's count, not NIXL's
  transfer: vLLM 0.31.0's prefill scheduler returns its ``num_cached_tokens``
  as ``remote_prefill_cached_tokens`` in ``kv_transfer_params``
  (``v1/core/sched/scheduler.py``), and the decode engine reports that value
  (``v1/engine/output_processor.py``).

A phase that must be served from cache passes when the evidence covers the
prompt but its last chunk: ``served >= prompt tokens - chunk tokens`` (LMCache
stores whole 256-token chunks; vLLM always computes at least the last token).
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

from .common import OpsError

HITS_METRIC = "vllm:external_prefix_cache_hits"
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def counter_total(text: str, name: str) -> float | None:
    """Sum of every sample of counter ``name`` (with or without ``_total``); None when absent."""
    total: float | None = None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None or match.group("name") not in (name, name + "_total"):
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        total = value if total is None else total + value
    return total


def metrics_url(base: str) -> str:
    """``http://host:port`` -> ``http://host:port/metrics``; a URL with a path is kept."""
    head, sep, path = base.partition("://")
    rest = path.split("/", 1)
    if len(rest) == 1 or not rest[1]:
        return f"{head}{sep}{rest[0]}/metrics"
    return base


class HitCounter:
    """The summed connector hit counter of some engines."""

    def __init__(self, http: Any, urls: list[str], timeout_s: float = 10.0) -> None:
        self.http = http
        self.urls = [metrics_url(u) for u in urls]
        self.timeout_s = timeout_s

    async def _one(self, url: str) -> float | None:
        import aiohttp

        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.http.get(url) as resp:
                    if resp.status != 200:
                        return None
                    text = await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError):
            return None
        return counter_total(text, HITS_METRIC)

    async def read(self) -> float | None:
        """The sum over every engine; None when any of them does not serve the counter."""
        values = await asyncio.gather(*(self._one(url) for url in self.urls))
        if any(v is None for v in values):
            return None
        return float(sum(values))  # type: ignore[arg-type]

    async def require(self) -> float:
        values = await asyncio.gather(*(self._one(url) for url in self.urls))
        missing = [url for url, v in zip(self.urls, values) if v is None]
        if missing:
            raise OpsError(f"--metrics-url: no {HITS_METRIC} counter at {', '.join(missing)} "
                           "(not a vLLM engine, or its KV connector is not configured)")
        return float(sum(values))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Verdict:
    served: bool
    detail: str


def judge(prompt_tokens: int, chunk_tokens: int, connector_hits: float | None, cached_tokens: int | None,
          metrics_where: str) -> Verdict:
    """Did the cache serve this prompt? (see the module docstring)."""
    needed = max(0, prompt_tokens - chunk_tokens)
    if connector_hits is not None:
        hits = int(connector_hits)
        if hits >= needed:
            return Verdict(True, f"connector served {hits} of {prompt_tokens} tokens ({HITS_METRIC})")
        detail = (f"the KV connector served {hits} of {prompt_tokens} tokens ({HITS_METRIC} on {metrics_where} "
                  f"rose by {hits}; at least {needed} needed): the cache did not serve the prompt")
        if cached_tokens is not None and cached_tokens >= needed:
            detail += (f"; usage reports {cached_tokens} cached tokens, so vLLM's own prefix cache (through a "
                       "P/D proxy: the prefill engine's) served it, not LMCache: start vLLM with "
                       "--no-enable-prefix-caching or pass --reset-prefix-cache")
        return Verdict(False, detail)
    if cached_tokens is not None:
        if cached_tokens >= needed:
            return Verdict(True, f"usage reports {cached_tokens} of {prompt_tokens} tokens cached")
        return Verdict(False, f"usage reports {cached_tokens} of {prompt_tokens} tokens cached (at least {needed} "
                              "needed): the cache did not serve the prompt")
    return Verdict(False, "no evidence that the cache served the prompt: the answer's usage has no "
                          "prompt_tokens_details.cached_tokens (start vLLM with --enable-prompt-tokens-details) "
                          f"and {metrics_where} serves no {HITS_METRIC} counter (pass --metrics-url of the "
                          "engines that run the KV connector)")
