"""Synthetic request streams for the replay, when no production log exists.

Arrivals are a Poisson process (exponential gaps at ``rate`` requests/s,
first request at 0 s). Prompt lengths in tokens are drawn from a seeded
distribution between ``min_tokens`` and ``max_tokens`` (log-uniform by
default, or a weighted histogram of bins, log-uniform inside a bin).

Prefix reuse: with probability ``reuse_share`` a request reuses an earlier
*fresh* prompt (its "document"): it keeps the first ``prefix_share`` of that
prompt's words and continues with words of its own up to the document's
length. With ``prefix_share = 1`` the prompt repeats exactly. Fresh prompts
start with ``[<salt>-<index>]`` so no two fresh prompts share even their
first cache chunk: ``reuse_share = 0`` gives a cold stream, ``0.9`` a
hit-heavy one. Replaying a stream twice primes the cache on the first pass.

Token counts come from :mod:`wordtext` (one token per word plus one per
sentence, an estimate) or from a ``tokens_per_word`` ratio measured against
the server's tokenizer.
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .common import OpsError
from .stream import StreamRequest
from .wordtext import approx_tokens, random_words, words_for_tokens, words_to_text

PROMPT_TOKEN_FLOOR = 9_000
PROMPT_TOKEN_CEILING = 200_000


@dataclass(frozen=True)
class LengthBin:
    low: int
    high: int
    weight: float


def parse_histogram(spec: str) -> list[LengthBin]:
    """``"9000-16000:50,16000-64000:30,64000-200000:20"`` -> bins (weights need not sum to 1)."""
    bins: list[LengthBin] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            span, weight_text = part.split(":")
            low_text, high_text = span.split("-")
            low, high, weight = int(low_text), int(high_text), float(weight_text)
        except ValueError:
            raise OpsError(
                f"--length-histogram: bad bin {part!r}; expected LOW-HIGH:WEIGHT, e.g. 9000-16000:50"
            ) from None
        if not 0 < low <= high:
            raise OpsError(f"--length-histogram: bin {part!r} needs 0 < LOW <= HIGH")
        if weight < 0 or not math.isfinite(weight):
            raise OpsError(f"--length-histogram: bin {part!r} has a negative weight")
        bins.append(LengthBin(low, high, weight))
    if not bins or sum(b.weight for b in bins) <= 0:
        raise OpsError(f"--length-histogram {spec!r}: needs at least one bin with a weight > 0")
    return bins


@dataclass
class GeneratorConfig:
    count: int
    rate_per_s: float
    seed: int = 0
    min_tokens: int = PROMPT_TOKEN_FLOOR
    max_tokens: int = PROMPT_TOKEN_CEILING
    histogram: list[LengthBin] | None = None
    reuse_share: float = 0.0
    prefix_share: float = 0.95
    output_tokens: int = 1
    tokens_per_word: float | None = None
    salt: str = ""

    def validate(self) -> None:
        if self.count < 1:
            raise OpsError(f"--count must be >= 1, got {self.count}")
        if not self.rate_per_s > 0:
            raise OpsError(f"--rate must be > 0 requests/s, got {self.rate_per_s}")
        if not 0 < self.min_tokens <= self.max_tokens:
            raise OpsError(
                f"--min-tokens {self.min_tokens} / --max-tokens {self.max_tokens}: need 0 < min <= max"
            )
        if not 0 <= self.reuse_share <= 1 or not 0 < self.prefix_share <= 1:
            raise OpsError("--reuse-share must be in [0, 1] and --prefix-share in (0, 1]")
        if self.tokens_per_word is not None and not self.tokens_per_word > 0:
            raise OpsError(f"tokens per word must be > 0, got {self.tokens_per_word}")


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    if low == high:
        return low
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def sample_prompt_tokens(rng: random.Random, config: GeneratorConfig) -> int:
    if config.histogram:
        weights = [b.weight for b in config.histogram]
        chosen = rng.choices(config.histogram, weights=weights, k=1)[0]
        return _log_uniform(rng, chosen.low, chosen.high)
    return _log_uniform(rng, config.min_tokens, config.max_tokens)


@dataclass
class _Document:
    index: int
    word_seed: int
    word_count: int
    header: str


@dataclass(frozen=True)
class GeneratedRequest:
    request: StreamRequest
    approx_prompt_tokens: int
    reuses: str | None  # id of the request whose prefix this one reuses
    shared_words: int

    def extra_fields(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"approx_prompt_tokens": self.approx_prompt_tokens}
        if self.reuses is not None:
            extra["reuses"] = self.reuses
            extra["shared_words"] = self.shared_words
        return extra


def generate(config: GeneratorConfig) -> Iterator[GeneratedRequest]:
    """Yield the stream's requests in offset order; deterministic for a config."""
    config.validate()
    rng = random.Random(config.seed)
    salt = config.salt or f"s{config.seed}"
    documents: list[_Document] = []
    offset = 0.0
    for index in range(config.count):
        if index > 0:
            offset += rng.expovariate(config.rate_per_s)
        request_id = f"r{index:05d}"
        reuse = bool(documents) and rng.random() < config.reuse_share
        own_seed = rng.getrandbits(64)
        if reuse:
            document = rng.choice(documents)
            shared = max(1, int(document.word_count * config.prefix_share))
            parent_words = random_words(random.Random(document.word_seed), document.word_count)
            words = parent_words[:shared] + random_words(random.Random(own_seed), document.word_count - shared)
            header = document.header
            reuses: str | None = f"r{document.index:05d}"
        else:
            target_tokens = sample_prompt_tokens(rng, config)
            header = f"[{salt}-{index:05d}]"
            word_count = words_for_tokens(target_tokens, config.tokens_per_word)
            document = _Document(index, own_seed, word_count, header)
            documents.append(document)
            words = random_words(random.Random(own_seed), word_count)
            shared = 0
            reuses = None
        prompt = header + " " + words_to_text(words)
        if config.tokens_per_word is None:
            approx = approx_tokens(len(words)) + 4  # the header is a few tokens
        else:
            approx = round(len(words) * config.tokens_per_word) + 4
        yield GeneratedRequest(
            request=StreamRequest(
                id=request_id, offset_s=round(offset, 6), max_tokens=config.output_tokens, prompt=prompt
            ),
            approx_prompt_tokens=approx,
            reuses=reuses,
            shared_words=shared,
        )
