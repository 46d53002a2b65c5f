"""The prompt the scenarios send and how their outputs are compared."""
from __future__ import annotations

import random

CHUNK = 256      # configs/prefill/lmcache.yaml's chunk_size (the scenarios assert it)
CHUNKS = 4
# 1,039 token ids of the tiny model's word vocabulary (tests/support/tiny_mla.py):
# four full chunks and a 15-token tail that is no full chunk, so not stored
# (save_unfull_chunk false).
PROMPT = [3 + random.Random(16).randrange(2000) for _ in range(CHUNKS * CHUNK + 15)]
STORED = CHUNKS * CHUNK
# Another prompt of the same shape, sharing no chunk with PROMPT.
OTHER_PROMPT = [3 + random.Random(17).randrange(2000) for _ in range(CHUNKS * CHUNK + 15)]


def same_output(a, b) -> None:
    """Exactly the same tokens and top-k logprobs of every generated token."""
    assert a.completion.tokens == b.completion.tokens
    assert a.completion.logprobs == b.completion.logprobs
