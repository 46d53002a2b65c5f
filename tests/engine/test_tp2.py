"""TP=2 over gloo with ``{rank}`` in remote_url: one Valkey per rank.

The prefill preset at TP 2 (its PCP 8 cannot run here, see cpu_overlay) with
three LMCache settings that make each rank a full participant, as LMCache
runs TP without MLA:

* ``save_only_first_rank: false`` and ``remote_enable_mla_worker_id_as0:
  false``: each rank stores its own KV under its own worker id (under MLA,
  LMCache otherwise has rank 0 store for both and rank 1 skip its puts and
  read worker 0's keys, so instance 1 would stay empty; the preset's PCP
  sharded store, which writes from every rank, needs PCP > 1);
* ``lookup_server_worker_ids: [0, 1]``: both ranks prefetch their own chunks
  under async loading (under MLA only rank 0 runs a lookup server by default;
  without one, rank 1 "Retrieved 0 out of 1024 required tokens" and vLLM
  recomputed the whole request).

Instance r must hold exactly rank r's keys (LMCache's key carries the worker
id), and after an engine restart both ranks load from their own instance,
with the logprobs of the L1-served run.
"""
from __future__ import annotations

import pytest

from tests.engine.prompts import CHUNKS, PROMPT, STORED, same_output
from tests.support import cpu_overlay
from tests.support.engine import observe
from tests.support.ports import free_port_block
from tests.support.valkey import start_valkey

RANKS = 2
LOOKUP_BOUND_S = 120
REQUEST_TIMEOUT_S = LOOKUP_BOUND_S + 120.0   # above the lookup's bound: a recompute after it still answers


def _worker_ids(valkey) -> list[int]:
    """The worker id of every key in one instance (LMCache's key string:
    model@world_size@worker_id@hash@dtype, then its tags, the chunk layout among them)."""
    return sorted(int(key.decode().split("@")[2]) for key in valkey.client().keys("*"))


@pytest.mark.engine
def test_tp2_rank_per_valkey(engines, tiny_model, tmp_path):
    base = free_port_block(RANKS)
    valkeys = []
    for rank in range(RANKS):
        (tmp_path / f"valkey-{rank}").mkdir()
        valkeys.append(start_valkey(tmp_path / f"valkey-{rank}", port=base + rank))
    try:
        spec = cpu_overlay.cpu_spec("prefill", tiny_model, base, label="prefill-tp2")
        assert "{rank}" in spec.lmcache_config["remote_url"]
        spec.vllm_config["tensor-parallel-size"] = RANKS
        # Each rank runs one unbound OpenMP thread (the harness's ENGINE_THREADS): with a
        # core bound to each rank, a rank whose core was busy held the other at every
        # all-reduce.
        extra = spec.lmcache_config.setdefault("extra_config", {})
        extra["save_only_first_rank"] = False
        extra["remote_enable_mla_worker_id_as0"] = False
        spec.lmcache_config["lookup_server_worker_ids"] = list(range(RANKS))
        # Two ranks on two cores, each pinned to one with its OpenMP threads: rank 1's
        # first GET after a restart has taken over the preset's 5 s bound here (CI,
        # "batched_get_non_blocking timed out", then a 4 s lookup miss), and with a
        # second heavy process beside the run the restarted engine's first lookup took
        # 21 s on rank 0 and 32 s on rank 1. This test is about which instance each rank
        # reads, not the preset's latency budget, so the bounds are bounds on a hang:
        # a GET that never answers still fails it.
        spec.lmcache_config["lookup_timeout_ms"] = LOOKUP_BOUND_S * 1000
        spec.lmcache_config["blocking_timeout_secs"] = LOOKUP_BOUND_S
        first = engines.start(spec)

        cold = observe(first, valkeys, PROMPT, sets=[CHUNKS] * RANKS, timeout_s=REQUEST_TIMEOUT_S)
        assert cold.counts.stored == RANKS * STORED, cold.summary()
        assert [c.get("set") for c in cold.calls] == [CHUNKS] * RANKS, cold.summary()
        assert [_worker_ids(v) for v in valkeys] == [[r] * CHUNKS for r in range(RANKS)]

        l1 = observe(first, valkeys, PROMPT, timeout_s=REQUEST_TIMEOUT_S)
        assert l1.counts.retrieved == RANKS * STORED and l1.counts.stored == 0, l1.summary()
        assert all(not {"get", "set"} & set(c) for c in l1.calls), l1.summary()
        engines.stop(first)

        second = engines.start(spec)
        l2 = observe(second, valkeys, PROMPT, timeout_s=REQUEST_TIMEOUT_S)
        assert l2.counts.retrieved == RANKS * STORED and l2.counts.stored == 0, l2.summary()
        assert [c.get("get") for c in l2.calls] == [CHUNKS] * RANKS, l2.summary()
        same_output(l2, l1)
        print(f"TP2 cold {cold.summary()}\nTP2 L1 {l1.summary()}\nTP2 L2 {l2.summary()}")
    finally:
        for valkey in valkeys:
            valkey.stop()
