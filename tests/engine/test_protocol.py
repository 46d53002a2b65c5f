"""The write-up's correctness protocol on a real engine started from configs/prefill.

cold, then from L1, then from L2 after an engine restart, then cold again (L1
emptied through LMCache's internal API, Valkey flushed). The cache-served
runs must give exactly the same logprobs (a shuffled chunk moves them by
~1e-6: a tolerance cannot catch ordering bugs), and so must the two cold
runs; a cold run differs from a cache-served one by ~1e-3 even in float32
(the prefill is computed in another split), so cold is compared with cold
only. Every step asserts its cache evidence: LMCache's own stored/retrieved
counts, Valkey's SET/GET/EXISTS deltas and the server's ``cached_tokens``.

It runs on the shared prefill engine (shared.py: configs/prefill on the CPU
overlay, as this scenario always did) and its restart, which saves an engine
start of its own. What that engine adds changes none of this evidence: the
character tokenizer (the prompts are token ids, the weights the same),
``--enable-prompt-tokens-details`` (one more piece of evidence) and the
forwarding proxy in front of its Valkey, which relays every command and reply
byte for byte while no hook is armed (resp_hook.py); the counts are read from
the real Valkey. The scenario first empties both tiers (the other users of
the engine leave theirs filled).
"""
from __future__ import annotations

import pytest

from tests.engine.prompts import CHUNK, CHUNKS, PROMPT, STORED, same_output
from tests.support.engine import observe


@pytest.mark.engine
def test_cold_l1_l2_cold(shared_prefill):
    shared = shared_prefill
    valkey = shared.valkey
    assert shared.spec.lmcache_config["chunk_size"] == CHUNK
    shared.clear_l1()
    valkey.client().flushall()

    cold = observe(shared.server, [valkey], PROMPT, sets=[CHUNKS])
    assert (cold.counts.stored, cold.counts.retrieved) == (STORED, 0), cold.summary()
    assert cold.calls[0].get("set") == CHUNKS and "get" not in cold.calls[0], cold.summary()
    assert cold.completion.cached_tokens == 0, cold.completion.cached_tokens
    assert valkey.client().dbsize() == CHUNKS

    l1 = observe(shared.server, [valkey], PROMPT)
    assert (l1.counts.stored, l1.counts.retrieved, l1.counts.required) == (0, STORED, STORED), l1.summary()
    assert not {"get", "set", "exists"} & set(l1.calls[0]), f"L1 hit must not touch Valkey: {l1.summary()}"
    assert l1.completion.cached_tokens == STORED, l1.completion.cached_tokens

    shared.restart()
    l2 = observe(shared.server, [valkey], PROMPT)
    assert (l2.counts.stored, l2.counts.retrieved, l2.counts.required) == (0, STORED, STORED), l2.summary()
    assert l2.calls[0].get("get") == CHUNKS and "set" not in l2.calls[0], l2.summary()
    assert l2.completion.cached_tokens == STORED, l2.completion.cached_tokens
    same_output(l2, l1)

    # Neither tier may hold the prompt: L1 (an L2 load may have left its chunks
    # there) emptied through LMCache's API, Valkey flushed.
    removed = shared.clear_l1()
    valkey.client().flushall()
    cold_again = observe(shared.server, [valkey], PROMPT, sets=[CHUNKS])
    assert (cold_again.counts.stored, cold_again.counts.retrieved, cold_again.counts.hit) == (STORED, 0, 0), \
        cold_again.summary()
    assert cold_again.calls[0].get("set") == CHUNKS and "get" not in cold_again.calls[0], cold_again.summary()
    same_output(cold_again, cold)
    print(f"L1 entries cleared before the second cold run: {removed}")
    print(f"cold {cold.summary()}\nL1 {l1.summary()}\nL2 {l2.summary()}\ncold again {cold_again.summary()}")
