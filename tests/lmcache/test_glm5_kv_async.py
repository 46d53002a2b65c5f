"""GLM-5's whole KV through LMCache's async loading path, byte for byte
(issue 15; the prefill preset runs ``enable_async_loading: true``).

The same worker as test_glm5_kv_roundtrip.py (vLLM 0.31.0's own spec,
grouping and allocation for a tiny ``GlmMoeDsaForCausalLM`` with GLM-5.3's
layer pattern: 8 latent and 3 indexer caches; LMCache's real
adapter with ``use_gpu_connector_v3``; see glm5_lmcache_run.py for what
stands in for CUDA), with ``enable_async_loading``: the adapter's real
``LMCacheAsyncLookupServer`` prefetches with pin=True what vLLM's
scheduler-side ``LMCacheConnectorV1`` asks for through its
``LMCacheAsyncLookupClient`` (ZMQ), the load takes the prefetched objects,
and ``lookup_unpin`` (``wait_for_save``) ends the request.

Checked for every loaded token: every byte of its latent row (576, or 656
with fp8_ds_mla) and its indexer values and scale; vLLM's cached prefix left
as it was; the DSA indexer's top-k on the restored cache equal to the
original's; and every L1 chunk of the prompt pinned once by the prefetch and
holding no pin and only the cache's reference after the request.
"""

from __future__ import annotations

import pytest

from tests.lmcache import glm5_lmcache_run
from tests.lmcache.glm5_vllm_kv import indexer_layers, token_bytes
from tests.lmcache.test_glm5_kv_roundtrip import (
    CASES,
    LOAD_BLOCKS,
    REMOTE_CASES,
    REMOTE_LOAD_BLOCKS,
    REMOTE_STORE_BLOCKS,
    STORE_BLOCKS,
    V3_GROUPS,
    VARIANTS,
    WITHOUT_V3_GROUPS,
    check_case,
    check_groups,
    check_registered,
    valkey_env,
)
from tests.support.pcp_ranks import run_processes

pytestmark = pytest.mark.lmcache

CHUNK = glm5_lmcache_run.CHUNK_SIZE


def run_async(tmp_path, variant, cases, store_blocks=STORE_BLOCKS, load_blocks=LOAD_BLOCKS, **kwargs) -> dict:
    (result,) = run_processes(
        1,
        glm5_lmcache_run.round_trip,
        tmp_path,
        timeout_s=300,
        variant=variant,
        cases=cases,
        store_blocks=store_blocks,
        load_blocks=load_blocks,
        async_loading=True,
        **kwargs,
    )
    return result


def check_async_case(case: dict, from_l1: bool) -> None:
    """The lookup answered the prompt, the prefetch holds one object per
    chunk to load (an L1 chunk pinned once, with the cache's and the
    prefetch's reference), the bytes came back, and after the request no
    object holds a pin or the prefetch's reference: an L1 chunk only the
    cache's, an object read from L2 none (it is freed)."""
    where = f"{case['num_tokens']} tokens, vLLM holding {case['vllm_cached_tokens']}"
    assert "store_error" not in case and "load_error" not in case, (where, case)
    expected = case.get("loads", case["num_tokens"])
    assert case["lookup_answer"] == expected, (where, case["lookup_answer"])
    starts = list(range(0, expected, CHUNK))
    held = [True, 2, 1] if from_l1 else [False, 1, 0]
    assert case["prefetched_objects"] == {start: held for start in starts}, (where, case["prefetched_objects"])
    check_case(case)
    released = {start: [from_l1, int(from_l1), 0] for start in starts}
    assert case["prefetched_objects_after"] == released, (
        f"{where}: after the request no prefetched object may hold a pin or the prefetch's reference; "
        f"(in L1, ref_count, pin_count) by chunk start = {case['prefetched_objects_after']}")
    if from_l1:
        assert case["after"] == {start: [1, 0] for start in starts}, (where, case["after"])


@pytest.mark.fixes(V3_GROUPS, fails_with=WITHOUT_V3_GROUPS)
@pytest.mark.parametrize(("variant", "latent_bytes"), VARIANTS)
def test_async_round_trip_through_local_cpu_into_other_blocks(tmp_path, variant, latent_bytes):
    result = run_async(tmp_path, variant, CASES)
    check_registered(result)
    assert result["lookup"] == ["LMCacheAsyncLookupServer", "LMCacheAsyncLookupClient"], result["lookup"]
    check_groups(result, latent_bytes)
    for case in result["cases"]:
        check_async_case(case, from_l1=True)


@pytest.mark.fixes(V3_GROUPS, fails_with=WITHOUT_V3_GROUPS)
@pytest.mark.parametrize(("variant", "latent_bytes"), VARIANTS)
def test_async_round_trip_through_valkey_in_a_fresh_process(tmp_path, valkey, variant, latent_bytes):
    env = valkey_env(valkey)
    (tmp_path / "store").mkdir()
    (tmp_path / "load").mkdir()
    common = dict(store_blocks=REMOTE_STORE_BLOCKS, load_blocks=REMOTE_LOAD_BLOCKS,
                  model_dir=str(tmp_path / "model"), lmcache_env=env)
    stored = run_async(tmp_path / "store", variant, REMOTE_CASES, phase="store", **common)
    check_registered(stored)
    for case in stored["cases"]:
        assert "store_error" not in case, case["store_error"]
    assert stored["remote_holds_all"], stored["backends"]
    # A new worker (an engine restart): its L1 is empty, the prefetch reads Valkey.
    loaded = run_async(tmp_path / "load", variant, REMOTE_CASES, phase="load", **common)
    check_registered(loaded)
    check_groups(loaded, latent_bytes)
    import json
    print(json.dumps([{k: v for k, v in c.items() if k != "topk"} for c in loaded["cases"]], default=str))
    for case in loaded["cases"]:
        check_async_case(case, from_l1=False)


# Without the staging buffer (as here) the connector builds one group at the
# first store, in the first layer's format (the indexer's blocked pages), with
# its 3 layers' pointers, and copies the metadata's 8 layers: the store's copy
# indexes past the third pointer.
WITHOUT_V3_GROUPS_UNSTAGED = (r"_blocked_scales_kv_transfer.*"
                              r"IndexError: index 3 is out of bounds for dimension 0 with size 3")


@pytest.mark.fixes(V3_GROUPS, fails_with=WITHOUT_V3_GROUPS_UNSTAGED)
@pytest.mark.parametrize("vllm_cached_tokens", [0, 256])
def test_async_round_trip_through_the_pcp_sharded_store(tmp_path, vllm_cached_tokens):
    # 1100 tokens at W = 2: four full chunks (rank 0 owns 0 and 512, rank 1
    # 256 and 768) and a partial one the sharded store does not keep; with
    # vLLM holding the first chunk, rank 0's prefetched chunk 0 is masked.
    world_size = 2
    results = run_processes(
        world_size,
        glm5_lmcache_run.sharded_round_trip,
        tmp_path,
        timeout_s=500,
        variant="flashmla_fp8_ds_mla",
        num_tokens=1100,
        store_blocks=list(range(0, 36, 2)),
        load_blocks=list(range(1, 36, 2)),
        num_blocks=40,
        async_loading=True,
        vllm_cached_tokens=vllm_cached_tokens,
    )
    assert {b for r in results for b in r["owned_chunk_bytes"]} == {CHUNK * token_bytes(656)}
    # The sharded load's staging buffer holds at least one whole chunk (both parts).
    assert {r["staging_buffer_bytes"] for r in results} == {CHUNK * token_bytes(656)}
    for rank, result in enumerate(results):
        owned = [start for start in range(0, 1024, CHUNK) if start // CHUNK % world_size == rank]
        assert result["lookup_answer"] == 1024, (rank, result["lookup_answer"])
        assert result["prefetched"] == {start: [2, 1] for start in owned}, (rank, result["prefetched"])
        assert result["loaded_end"] == 1024, (rank, result["loaded_end"])
        assert result["mismatched_tokens"] == {name: 0 for name in result["mismatched_tokens"]}, (
            rank, result["mismatched_tokens"])
        assert len(result["topk"]) == len(indexer_layers())
        for name, topk in result["topk"].items():
            assert topk["restored"] == topk["original"], (rank, name)
        assert result["after"] == {start: [1, 0] for start in owned}, (
            f"rank {rank}: after the request every L1 chunk must hold only the cache's reference and no pin; "
            f"(ref_count, pin_count) by chunk start = {result['after']}")
