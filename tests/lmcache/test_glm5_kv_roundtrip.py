"""GLM-5's whole KV through LMCache and back, byte for byte (issue 15).

vLLM 0.31.0 builds the ``kv_caches`` dict (tests/lmcache/glm5_vllm_kv.py) with
GLM-5.3's layer pattern: a latent cache on each of 8 decoder layers and a DSA
indexer cache on the 3 that run the indexer (0, 1, 5), so LMCache's two kernel
groups hold different layer counts and a group sized by another's count
fails here (see the negative control below); one worker process registers
it through vLLM's ``LMCacheConnectorV1`` with ``use_gpu_connector_v3``, stores
a prompt at one set of blocks, clears the cache and loads it into another
set, as a cache hit does (tests/lmcache/glm5_lmcache_run.py, which lists what
stands in for CUDA: LMCache's torch fallback copies run the transfer).

Checked for every loaded token: every byte of its latent row (576 bytes, or
656 with fp8_ds_mla) and its indexer values and scale, compared through the
blocked page layout; vLLM's cached prefix left as it was; and the DSA
indexer's top-k on the restored cache equal to the original's.
"""

from __future__ import annotations

import pytest

from tests.lmcache import glm5_lmcache_run
from tests.lmcache.glm5_vllm_kv import INDEXER_BYTES, NUM_LAYERS, indexer_layers, kvsizing_geometry, token_bytes
from tests.support.pcp_ranks import run_processes

pytestmark = pytest.mark.lmcache

CHUNK = glm5_lmcache_run.CHUNK_SIZE
ROLES = "0014-vllm-detect-mla-latent-and-dsa-indexer-caches-by-role.patch"
V3_GROUPS = "0015-v3-gpu-connector-move-each-kernel-group-with-its-own-geometry.patch"
FALLBACK = "0016-torch-ops-dsa-indexer-blocked-pages-in-the-fallback-copy.patch"
V3_ACCEPTED = "0017-vllm-accept-dsa-indexer-and-fp8-ds-mla-caches-under-v3.patch"

# Without it the first store's memory object is sized for one 576-wide group
# (the layer groups are built only at the first transfer) and later chunks
# are copied with the first group's format: wrong bytes.
# Without 0015 the series also lacks 0017 (it builds on 0015), so 0013's guard
# refuses what V3 could not move; with the guard out of the way the store fails
# with "size of tensor a (576) must match the size of tensor b (132)".
WITHOUT_V3_GROUPS = r"registration refused: UnsupportedKVCacheLayerError: LMCache cannot move"

STORE_BLOCKS = [5, 2, 9, 11, 0]
LOAD_BLOCKS = [7, 13, 1, 20, 4]  # none shared with the store's
VARIANTS = [("flashinfer_fp8", 576), ("flashmla_fp8_ds_mla", 656)]
# Prompts of a full chunk and a partial one (300) and of a partial chunk
# (130), neither a multiple of the 64-token block; vLLM holding none, one
# block, or a whole chunk of the prompt when it loads.
CASES = [
    {"num_tokens": 300, "vllm_cached_tokens": 0},
    {"num_tokens": 300, "vllm_cached_tokens": 64},
    {"num_tokens": 300, "vllm_cached_tokens": 256},
    {"num_tokens": 130, "vllm_cached_tokens": 0},
    {"num_tokens": 130, "vllm_cached_tokens": 64},
]


def run_round_trip(tmp_path, variant, cases=CASES, **kwargs) -> dict:
    (result,) = run_processes(
        1,
        glm5_lmcache_run.round_trip,
        tmp_path,
        timeout_s=300,
        variant=variant,
        cases=cases,
        store_blocks=STORE_BLOCKS,
        load_blocks=LOAD_BLOCKS,
        **kwargs,
    )
    return result


def check_registered(result: dict) -> None:
    error = result.get("register_error")
    assert error is None, f"registration refused: {error['type']}: {error['message']}"
    assert result["gpu_connector"] == "VLLMPagedMemGPUConnectorV3"


def check_groups(result: dict, latent_bytes: int, mtp_layers: int = 0) -> None:
    """One kernel group per kind of layer, each with its own format, row
    width and layer count (every layer's latent cache; the indexer caches of
    the layers that run the indexer), built at registration (before the first
    memory object)."""
    assert result["groups"] is not None, "no layer groups at registration"
    indexers = len(indexer_layers(NUM_LAYERS, mtp_layers))
    assert indexers != NUM_LAYERS + mtp_layers  # the groups' layer counts differ
    assert sorted(result["groups"]) == [
        ["NL_X_NB_BSV_BSS", indexers, INDEXER_BYTES], ["NL_X_NB_BS_HS", NUM_LAYERS + mtp_layers, latent_bytes]]


def check_case(case: dict) -> None:
    where = f"{case['num_tokens']} tokens, vLLM holding {case['vllm_cached_tokens']}"
    for step in ("store_error", "load_error"):
        assert step not in case, f"{where}: {step}: {case[step]}"
    assert case["loaded_end"] == case.get("loads", case["num_tokens"]), (where, case["loaded_end"])
    assert case["mismatched_tokens"] == {name: 0 for name in case["equal"]}, (where, case["mismatched_tokens"])
    assert all(case["equal"].values())
    assert all(case["cached_prefix_untouched"].values()), (where, case["cached_prefix_untouched"])
    # The top-k of every indexer layer, and only of those.
    assert sorted(case["topk"]) == sorted(name for name in case["equal"] if ".indexer." in name)
    assert case["topk"]
    for name, topk in case["topk"].items():
        assert topk["restored"] == topk["original"], (where, name)
        # The check can fail: without the indexer keys the selection differs.
        assert topk["unset"] != topk["original"], (where, name)


@pytest.mark.fixes(V3_GROUPS, fails_with=WITHOUT_V3_GROUPS)
@pytest.mark.parametrize(("variant", "latent_bytes"), VARIANTS)
def test_round_trip_through_local_cpu_into_other_blocks(tmp_path, variant, latent_bytes):
    result = run_round_trip(tmp_path, variant)
    check_registered(result)
    for case in result["cases"]:
        check_case(case)
    check_groups(result, latent_bytes)


# Valkey keeps full chunks only (LMCache's RESP backend needs
# save_unfull_chunk off): a load gets each prompt's whole chunks.
REMOTE_CASES = [
    {"num_tokens": 300, "vllm_cached_tokens": 64, "loads": 256},
    {"num_tokens": 576, "vllm_cached_tokens": 0, "loads": 512},
]
REMOTE_STORE_BLOCKS = [5, 2, 9, 11, 0, 17, 3, 21, 8]
REMOTE_LOAD_BLOCKS = [7, 13, 1, 20, 4, 22, 6, 15, 10]


def valkey_env(valkey) -> dict[str, str]:
    """LMCache's environment for a real Valkey as the remote tier (full chunks only)."""
    return {
        "LMCACHE_REMOTE_URL": f"resp://{valkey.host}:{valkey.port}",
        "LMCACHE_REMOTE_SERDE": "naive",
        "LMCACHE_SAVE_UNFULL_CHUNK": "False",
    }


@pytest.mark.fixes(V3_GROUPS, fails_with=WITHOUT_V3_GROUPS)
@pytest.mark.parametrize(("variant", "latent_bytes"), VARIANTS)
def test_round_trip_through_valkey_in_a_fresh_process(tmp_path, valkey, variant, latent_bytes):
    env = valkey_env(valkey)
    (tmp_path / "store").mkdir()
    (tmp_path / "load").mkdir()
    # One model directory: the model name is part of every chunk's key.
    common = dict(cases=REMOTE_CASES, store_blocks=REMOTE_STORE_BLOCKS, load_blocks=REMOTE_LOAD_BLOCKS,
                  model_dir=str(tmp_path / "model"))
    stored = run_processes(1, glm5_lmcache_run.round_trip, tmp_path / "store", timeout_s=300,
                           variant=variant, phase="store", lmcache_env=env, **common)[0]
    check_registered(stored)
    for case in stored["cases"]:
        assert "store_error" not in case, case["store_error"]
    check_groups(stored, latent_bytes)
    assert stored["remote_holds_all"], stored["backends"]
    # A new worker (an engine restart): its L1 is empty, every chunk comes from Valkey.
    loaded = run_processes(1, glm5_lmcache_run.round_trip, tmp_path / "load", timeout_s=300,
                           variant=variant, phase="load", lmcache_env=env, **common)[0]
    check_registered(loaded)
    for case in loaded["cases"]:
        check_case(case)
    check_groups(loaded, latent_bytes)
    # Valkey holds each chunk whole: both layers' latent rows and indexer pages.
    client = valkey.client()
    sizes = {client.strlen(key) for key in client.keys("*")}
    assert sizes == {CHUNK * token_bytes(latent_bytes)}, sizes


# Without the staging buffer (as here) the connector builds one group at the
# first store, in the first layer's format (the indexer's blocked pages), with
# its 3 layers' pointers, and copies the metadata's 8 layers: the store's copy
# indexes past the third pointer.
WITHOUT_V3_GROUPS_UNSTAGED = (r"_blocked_scales_kv_transfer.*"
                              r"IndexError: index 3 is out of bounds for dimension 0 with size 3")


@pytest.mark.fixes(V3_GROUPS, fails_with=WITHOUT_V3_GROUPS_UNSTAGED)
@pytest.mark.parametrize("world_size", [2, 4])
def test_round_trip_through_the_pcp_sharded_store(tmp_path, world_size):
    # 1100 tokens: four full chunks (one per rank at W = 4) and a partial
    # one the sharded store does not keep; stored at even blocks, loaded
    # into odd ones.
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
    )
    # The ranks split the chunks; each keeps both parts of the ones it owns.
    assert sum(r["owned_chunks"] for r in results) == 4
    assert all(r["owned_chunks"] == 4 // world_size for r in results)
    assert {b for r in results for b in r["owned_chunk_bytes"]} == {CHUNK * token_bytes(656)}
    for rank, result in enumerate(results):
        assert result["loaded_end"] == 1024, (rank, result["loaded_end"])
        assert result["mismatched_tokens"] == {name: 0 for name in result["mismatched_tokens"]}, (
            rank, result["mismatched_tokens"])
        assert len(result["topk"]) == len(indexer_layers())
        for name, topk in result["topk"].items():
            assert topk["restored"] == topk["original"], (rank, name)


@pytest.mark.fixes(ROLES, fails_with=r"indexer\.k_cache': 'NL_X_NB_BS_NH_CS")
@pytest.mark.parametrize(("variant", "latent_bytes"), VARIANTS)
def test_each_layer_is_detected_from_its_role(tmp_path, variant, latent_bytes):
    (formats,) = run_processes(1, glm5_lmcache_run.detected_formats, tmp_path, timeout_s=300, variant=variant)
    # Without the roles, every [NB, 1, BS, W] view reads as fused K/V.
    # (vLLM sizes the blocks from the allocation: one count for every layer.)
    (nb,) = {text.split("[")[1].split(",")[0] for text in formats.values()}
    indexers = {name: text for name, text in formats.items() if ".indexer." in name}
    assert indexers == {
        f"model.layers.{i}.self_attn.indexer.k_cache": f"NL_X_NB_BSV_BSS [{nb}, 64, 132]" for i in indexer_layers()}
    latents = {name: text for name, text in formats.items() if ".indexer." not in name}
    assert latents == {
        f"model.layers.{i}.self_attn.attn": f"NL_X_NB_BS_HS [{nb}, 64, {latent_bytes}]" for i in range(NUM_LAYERS)}


@pytest.mark.fixes(V3_ACCEPTED, fails_with=r"UnsupportedKVCacheLayerError.*a DSA indexer cache")
@pytest.mark.parametrize(("variant", "latent_bytes"), VARIANTS)
def test_v3_registration_accepts_latent_and_indexer_layers(tmp_path, variant, latent_bytes):
    result = run_round_trip(tmp_path, variant, cases=[])
    check_registered(result)
    check_groups(result, latent_bytes)


@pytest.mark.fixes(FALLBACK, fails_with=r"indexer\.k_cache': [1-9]")
def test_indexer_pages_survive_the_cpu_fallback_copy(tmp_path):
    # A partial block at the store and a load into other blocks: a per-token
    # row copy of the blocked page mixes tokens' values and scales.
    (case,) = run_round_trip(tmp_path, "flashinfer_fp8", cases=[{"num_tokens": 130, "vllm_cached_tokens": 0}])["cases"]
    check_case(case)


@pytest.mark.fixes(V3_GROUPS, fails_with=WITHOUT_V3_GROUPS)
@pytest.mark.parametrize(("variant", "latent_bytes"), VARIANTS)
def test_glm5_chunk_size_at_78_layers(tmp_path, variant, latent_bytes):
    """GLM-5.3 FP8's chunk: 256 tokens x (78 latent rows + 21 indexer rows of
    132 bytes), measured from the stored memory object: kv-sizing's figure."""
    geometry = kvsizing_geometry()
    result = run_round_trip(
        tmp_path, variant, cases=[{"num_tokens": CHUNK}], phase="store", num_layers=78
    )
    check_registered(result)
    (case,) = result["cases"]
    assert "store_error" not in case, case["store_error"]
    assert case["stored_chunk_bytes"] == [CHUNK * (78 * latent_bytes + 21 * 132)]
    expected = {576: geometry.CHUNK_BYTES, 656: geometry.FP8_DS_MLA_CHUNK_BYTES}[latent_bytes]
    assert case["stored_chunk_bytes"] == [expected] == [{576: 12_211_200, 656: 13_808_640}[latent_bytes]]


@pytest.mark.fixes(V3_GROUPS, fails_with=WITHOUT_V3_GROUPS)
def test_round_trip_with_an_mtp_layer(tmp_path):
    """With MTP speculative decoding (not what the presets run) the drafter's
    layer follows the decoder layers and always builds its indexer (vLLM's
    rule): 9 latent + 4 indexer caches."""
    result = run_round_trip(tmp_path, "flashinfer_fp8", cases=CASES[1:3], mtp_layers=1)
    check_registered(result)
    check_groups(result, 576, mtp_layers=1)
    assert f"model.layers.{NUM_LAYERS}.self_attn.indexer.k_cache" in result["cases"][0]["topk"]
    for case in result["cases"]:
        check_case(case)


def test_a_group_sized_by_another_groups_layer_count_fails_the_round_trip(tmp_path):
    """The negative control: LMCache's metadata sizes every kernel group's
    part of a chunk by group 0's layer count (glm5_lmcache_run's
    ``size_every_group_as_group0``). Group 0 holds the 3 indexer layers, so
    the latent part holds 3 of the 8 latent layers: nothing raises, and the
    latent layers past the third (in registration order) come back wrong on
    every loaded token. The round trip's own check sees it."""
    result = run_round_trip(tmp_path, "flashinfer_fp8", cases=CASES, group0_layer_count=True)
    check_registered(result)
    check_groups(result, 576)  # the groups themselves are right; only the sizing is not
    indexers = len(indexer_layers())
    for case in result["cases"]:
        assert "store_error" not in case and "load_error" not in case, case  # silent
        loaded = case["loaded_end"] - case["vllm_cached_tokens"]  # the tokens the load wrote
        latent = [name for name in case["mismatched_tokens"] if ".indexer." not in name]
        assert len(latent) == NUM_LAYERS
        expected = {name: (loaded if position >= indexers else 0) for position, name in enumerate(latent)}
        assert {name: case["mismatched_tokens"][name] for name in latent} == expected, case["mismatched_tokens"]
        assert all(case["mismatched_tokens"][name] == 0 for name in case["mismatched_tokens"] if name not in latent)
        with pytest.raises(AssertionError):
            check_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize(("variant", "latent_bytes"), VARIANTS)
def test_round_trip_through_lmcache_cuda_kernels(tmp_path, variant, latent_bytes):
    """The same round trip on a GPU: vLLM's dict on CUDA, LMCache's CUDA
    build (its multi_layer_kv_transfer kernels), nothing standing in."""
    result = run_round_trip(tmp_path, variant, device="cuda")
    check_registered(result)
    for case in result["cases"]:
        check_case(case)
    check_groups(result, latent_bytes)
