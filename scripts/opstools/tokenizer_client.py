"""Token counts from the server's own tokenizer: vLLM's ``POST /tokenize``.

vLLM 0.31.0 serves ``/tokenize`` (``vllm/entrypoints/serve/tokenize``):
request ``{"model", "prompt", "add_special_tokens"}``, response
``{"count", "max_model_len", "tokens"}``. ``count`` includes the special
tokens the completions endpoint adds to the same prompt (BOS) when
``add_special_tokens`` is true, its default and the completions default.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp

from .common import OpsError
from .wordtext import random_words, words_to_text


class TokenizerClient:
    def __init__(self, http: aiohttp.ClientSession, base_url: str, model: str, timeout_s: float = 120.0) -> None:
        self.http = http
        self.url = base_url.rstrip("/") + "/tokenize"
        self.model = model
        self.timeout_s = timeout_s
        self.calls = 0
        self.max_model_len: int | None = None

    async def count(self, text: str) -> int:
        self.calls += 1
        body = {"model": self.model, "prompt": text, "add_special_tokens": True}
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.http.post(self.url, json=body) as resp:
                    status = resp.status
                    raw = await resp.text(errors="replace")
        except aiohttp.ClientConnectorError as exc:
            raise OpsError(f"cannot connect to {self.url}: {exc}") from None
        except TimeoutError:
            raise OpsError(f"{self.url}: no answer within {self.timeout_s:g} s") from None
        if status == 404:
            raise OpsError(f"{self.url}: HTTP 404; the server has no /tokenize endpoint (vLLM serves one; "
                           "through a front end such as the P/D proxy pass --engine-url of an engine)")
        if status != 200:
            raise OpsError(f"{self.url}: HTTP {status}: {raw[:300]}")
        try:
            data = json.loads(raw)
            count = data["count"]
        except (ValueError, KeyError, TypeError):
            raise OpsError(f"{self.url}: answer has no 'count': {raw[:200]!r}") from None
        if not isinstance(count, int):
            raise OpsError(f"{self.url}: 'count' is not an integer: {count!r}")
        if isinstance(data.get("max_model_len"), int):
            self.max_model_len = data["max_model_len"]
        return count


async def measure_tokens_per_word(client: TokenizerClient, sample_words: int = 4000, seed: int = 0) -> float:
    """Tokens per word of :mod:`wordtext` text, as the server counts them."""
    import random

    rng = random.Random(seed)
    short = await client.count(words_to_text(random_words(rng, 10)))
    long_text = words_to_text(random_words(rng, sample_words + 10))
    long = await client.count(long_text)
    if long <= short:
        raise OpsError(f"{client.url}: token counts do not grow with the text ({short} then {long})")
    return (long - short) / sample_words
