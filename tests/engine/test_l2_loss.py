"""The write-up's eviction race on a real engine: chunk keys gone between
LMCache's lookup (EXISTS) and its load (GET).

The shared prefill engine (shared.py) serves every case. Its LMCache talks
to a real Valkey through ``resp_hook.ExistsHookProxy``, the fake that only
forces the interleaving (a real run cannot hit the sub-millisecond window on
demand, see its docstring); what happens in the window is real: a DEL of the
keys, or Valkey's own LRU eviction (``volatile-lru``) under ``maxmemory``. The
proxy's trace of the engine's commands shows the interleaving happened: four
EXISTS, the hook, then the four GETs.

Set-up: the prompt's first two chunks are stored alone (their keys are the
prefix keys), then the whole prompt is served with only those two in Valkey:
LMCache loads 512 tokens and vLLM computes the rest. That answer is the
reference of a race that takes the two suffix chunks away: with the fix the
request gets exactly that split, so exactly those logprobs. Before every case
L1 is emptied through LMCache's internal API and Valkey holds all four keys,
byte for byte as when the reference was taken.

Without 0002 the GET of a missing key wedges a worker of LMCache's native
RESP client, and the scheduler gives up after ``lookup_timeout_ms``
("still waiting for async lookup ..."), recomputing everything; without 0003
the unfilled buffers of the missing keys are handed to vLLM as KV.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

from tests.engine.prompts import CHUNK, CHUNKS, PROMPT
from tests.engine.shared import SharedPrefill
from tests.support.engine import Observation, observe

PREFIX_CHUNKS = 2
PREFIX = PROMPT[:PREFIX_CHUNKS * CHUNK + 7]     # two full chunks and a tail that is not stored
LOADED = PREFIX_CHUNKS * CHUNK
REQUEST_TIMEOUT_S = 120.0  # a bound on a hang: above the shared engine's lookup_timeout_ms
# LMCache's ways of saying a load hung until a timeout and the request was recomputed.
HUNG = re.compile(r"still waiting for async lookup.*|.*timed out.*|.*the GET is abandoned.*")


@dataclass
class Race:
    shared: SharedPrefill
    prefix_keys: set[bytes] = field(default_factory=set)
    suffix_keys: set[bytes] = field(default_factory=set)
    partial: Observation | None = None      # the prompt served with only the prefix chunks in Valkey
    chunks: dict[bytes, bytes] = field(default_factory=dict)   # every key's value when the reference was taken

    @property
    def server(self):
        return self.shared.server

    @property
    def valkey(self):
        return self.shared.valkey

    @property
    def proxy(self):
        return self.shared.proxy

    def prime(self) -> None:
        """Valkey with the prefix chunks only, the prompt served from them (the reference)."""
        client = self.valkey.client()
        client.flushall()
        self.shared.clear_l1()
        stored = observe(self.server, [self.valkey], PREFIX, sets=[PREFIX_CHUNKS])
        assert stored.counts.stored == LOADED and stored.calls[0].get("set") == PREFIX_CHUNKS, stored.summary()
        self.prefix_keys = set(client.keys("*"))
        self.shared.clear_l1()
        partial = observe(self.server, [self.valkey], PROMPT, sets=[CHUNKS - PREFIX_CHUNKS])
        assert (partial.counts.retrieved, partial.counts.stored) == (LOADED, (CHUNKS - PREFIX_CHUNKS) * CHUNK), \
            partial.summary()
        assert partial.calls[0].get("get") == PREFIX_CHUNKS, partial.summary()
        assert partial.calls[0].get("set") == CHUNKS - PREFIX_CHUNKS, partial.summary()
        self.suffix_keys = set(client.keys("*")) - self.prefix_keys
        assert len(self.suffix_keys) == CHUNKS - PREFIX_CHUNKS
        self.partial = partial
        keys = sorted(self.prefix_keys | self.suffix_keys)
        self.chunks = dict(zip(keys, client.mget(keys)))

    def ready(self) -> None:
        """L1 empty, Valkey holding the four chunks exactly as they were when the reference was taken.

        A case can change them, not only remove them: a lookup that gave up stores the whole
        prompt again, computed in one pass, and that KV differs from the stored prefix's in the
        last bits, so every later load of it would answer with other logprobs than the reference."""
        client = self.valkey.client()
        if client.mget(list(self.chunks)) != list(self.chunks.values()):
            client.mset(self.chunks)
        self.shared.clear_l1()

    def name(self, key: str) -> str:
        return {**{k.decode(): "prefix" for k in self.prefix_keys},
                **{k.decode(): "suffix" for k in self.suffix_keys}}.get(key, key[-24:])

    def run(self, hook) -> tuple[Observation, str, dict[str, int], list[tuple[str, str, bytes]]]:
        """The prompt with ``hook`` run between its EXISTS and its GETs: the answer, the log,
        Valkey's stats deltas and the proxy's trace of the engine's commands around it."""
        self.ready()
        before = self.valkey.client().info("stats")
        mark = self.server.log_mark()
        start = len(self.proxy.trace)
        self.proxy.arm(hook, exists=CHUNKS)
        try:
            race = observe(self.server, [self.valkey], PROMPT, timeout_s=REQUEST_TIMEOUT_S)
        finally:
            self.proxy.disarm()
        after = self.valkey.client().info("stats")
        if self.proxy.hook_error is not None:
            raise self.proxy.hook_error
        stats = {k: after[k] - before[k] for k in ("keyspace_hits", "keyspace_misses", "evicted_keys")}
        trace = [(command, self.name(key), reply) for command, key, reply in self.proxy.trace[start:]]
        # The interleaving the case is about: all four keys looked up, the hook, then all four asked for.
        commands = [c for c, _, _ in trace]
        assert "HOOK" in commands, f"the request sent no EXISTS: it was not looked up in Valkey ({race.summary()})"
        hook_at = commands.index("HOOK")
        looked_up = [k for c, k, r in trace if c == "EXISTS" and r == b":1"]
        loads = [(i, k) for i, (c, k, _) in enumerate(trace) if c == "GET"]
        assert sorted(looked_up) == ["prefix"] * PREFIX_CHUNKS + ["suffix"] * (CHUNKS - PREFIX_CHUNKS), \
            f"the lookup did not find all four chunks in Valkey (L1 not empty?): {trace}"
        assert len(loads) == CHUNKS and all(i > hook_at for i, _ in loads), \
            f"the load did not ask for all four chunks after the hook: {trace}"
        return race, self.server.log_since(mark), stats, trace

    def check_recomputed_suffix(self, race: Observation, log: str, stats: dict[str, int]) -> None:
        """The fix's outcome: the prefix loaded, the missing suffix computed, exactly the reference,
        with no wait on the missing keys. The wait is read from LMCache's log (HUNG: the lookup
        given up on after ``lookup_timeout_ms``, a GET abandoned after its timeout), not from the
        clock, which on a loaded machine moves by as much as the timeout a comparison would resolve."""
        hung = HUNG.search(log)
        assert hung is None, (f"LMCache's load hung on the missing keys until its timeout "
                              f"({race.completion.seconds:.1f} s): {hung.group(0).strip()[-300:]}")
        assert race.counts.retrieved == LOADED, (f"LMCache served {race.counts.retrieved} tokens from Valkey, "
                                                 f"which held only {LOADED} when it loaded ({race.summary()})")
        # Valkey's view: four EXISTS and the two prefix GETs hit, the two suffix GETs missed.
        assert (stats["keyspace_hits"], stats["keyspace_misses"]) == \
            (CHUNKS + PREFIX_CHUNKS, CHUNKS - PREFIX_CHUNKS), stats
        assert race.completion.tokens == self.partial.completion.tokens \
            and race.completion.logprobs == self.partial.completion.logprobs, \
            "logprobs differ from the prompt served with only the prefix chunks in Valkey: " \
            + _first_difference(race.completion, self.partial.completion)


@pytest.fixture(scope="module")
def race(shared_prefill):
    state = Race(shared_prefill)
    state.prime()
    return state


@pytest.mark.engine
@pytest.mark.fixes("0002-redis-connector-missing-key-is-a-miss.patch",
                   fails_with=r"LMCache's load hung on the missing keys until its timeout")
def test_keys_deleted_between_lookup_and_load(race):
    def delete_suffix():
        assert race.valkey.client().delete(*race.suffix_keys) == len(race.suffix_keys)

    result, log, stats, trace = race.run(delete_suffix)
    race.check_recomputed_suffix(result, log, stats)
    print(f"deleted between lookup and load: {result.summary()}, valkey {stats}; "
          f"reference {race.partial.summary()}\nengine's commands: {trace}")


@pytest.mark.engine
@pytest.mark.fixes("0003-resp-connector-honour-per-key-get-results.patch",
                   fails_with=r"LMCache served 1024 tokens from Valkey, which held only 512")
def test_keys_evicted_by_lru_between_lookup_and_load(race):
    """Valkey's own LRU eviction takes the two suffix chunks between the lookup and the load.

    Only the suffix keys can go: they alone carry a TTL, and the policy is volatile-lru,
    which evicts among keys with a TTL. maxmemory drops to 1 byte, so Valkey evicts
    every such key and then stops, whatever else moved used_memory meanwhile (client
    buffers, the engine's connections, the allocator): the outcome does not hang on a
    memory figure read a moment before, as a budget of "used minus 1.5 chunks" under
    allkeys-lru did. The limit is lifted before the engine loads."""
    client = race.valkey.client()
    race.ready()
    evicted: dict[str, int] = {}

    def evict_suffix():
        before = client.info("stats")["evicted_keys"]
        for key in race.suffix_keys:
            assert client.expire(key, 24 * 3600)
        # Eviction frees in place: lazy eviction frees in the background, and Valkey
        # would go on evicting until the memory is back.
        client.config_set("lazyfree-lazy-eviction", "no")
        client.config_set("maxmemory-policy", "volatile-lru")
        client.config_set("maxmemory", 1)
        client.ping()   # eviction runs before the next command
        client.config_set("maxmemory", 0)
        evicted["keys"] = client.info("stats")["evicted_keys"] - before
        remaining = set(client.keys("*"))
        assert remaining == race.prefix_keys, \
            f"Valkey's eviction left {sorted(remaining)}, not the prefix chunks alone"

    try:
        result, log, stats, trace = race.run(evict_suffix)
    finally:
        client.config_set("maxmemory", 0)
        client.config_set("maxmemory-policy", "noeviction")
    assert evicted["keys"] == stats["evicted_keys"] == CHUNKS - PREFIX_CHUNKS, (evicted, stats)
    race.check_recomputed_suffix(result, log, stats)
    print(f"evicted by LRU between lookup and load: {result.summary()}, valkey {stats}\nengine's commands: {trace}")



def _first_difference(got, want) -> str:
    """Where two completions part: the first generated position whose tokens or top logprobs differ."""
    for position, (a, b) in enumerate(zip(got.logprobs, want.logprobs)):
        if a != b:
            gap = max((abs(a[k] - b[k]) for k in a.keys() & b.keys()), default=float("nan"))
            return f"from generated token {position} (largest top-k gap there {gap:.2e}): {a} vs {b}"
    return f"tokens {got.tokens} vs {want.tokens}"
