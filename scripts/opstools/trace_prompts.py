"""Prompt text for trace lines that give lengths and block hash ids instead of text.

Mooncake-style traces (and AIPerf's fixed schedule) describe a prompt by its
length in tokens and ``hash_ids``: one id per block of :data:`BLOCK_TOKENS`
tokens, equal ids for equal blocks. The text built here keeps that sharing:
a block's words depend only on its id (and the salt), so two prompts whose
hash ids begin alike begin with the same text, and an engine's prefix cache
sees the shared prefix. A last block shorter than a full one is the start of
that block's text. Tokens past the blocks (or every token, without hash ids)
are words of the request's own, so they share nothing.

Lengths follow :mod:`wordtext`'s estimate (one token per word plus one per
sentence), so a 512-token block is about 512 tokens of a byte-pair
vocabulary; the text is built when the request is about to be sent, not when
the trace is read, so a long trace does not sit in memory as text.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from .wordtext import random_words, words_for_tokens, words_to_text

BLOCK_TOKENS = 512


@lru_cache(maxsize=4096)
def block_words(salt: str, hash_id: int) -> tuple[str, ...]:
    """The words of one full block; the same for the same id and salt."""
    rng = random.Random(f"{salt}:block:{hash_id}")
    return tuple(random_words(rng, words_for_tokens(BLOCK_TOKENS)))


@dataclass(frozen=True)
class SyntheticPrompt:
    input_tokens: int
    hash_ids: tuple[int, ...]
    own_seed: str  # seeds the words past the blocks; unique per request
    salt: str = ""

    def text(self) -> str:
        pieces: list[str] = []
        left = self.input_tokens
        for hash_id in self.hash_ids:
            if left <= 0:
                break
            words = block_words(self.salt, hash_id)
            if left < BLOCK_TOKENS:
                words = words[: words_for_tokens(left)]
            pieces.append(words_to_text(list(words)))
            left -= BLOCK_TOKENS
        if left > 0:
            rng = random.Random(f"{self.salt}:own:{self.own_seed}")
            pieces.append(words_to_text(random_words(rng, words_for_tokens(left))))
        return " ".join(pieces)
