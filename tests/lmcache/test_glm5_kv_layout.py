"""GLM-5's KV cache as vLLM 0.31.0 registers it, through LMCache (issue 15).

vLLM builds the ``kv_caches`` dict with its own spec, layout, grouping and
allocation code (tests/lmcache/glm5_vllm_kv.py); a worker process hands it to
LMCache's real adapter through vLLM's ``LMCacheConnectorV1`` and stores and
loads a prompt (tests/lmcache/glm5_lmcache_run.py, which lists what stands in
for CUDA). Two backends are covered: FLASHINFER_MLA_SPARSE with fp8 (the
prefill preset: 576-byte latent rows) and FLASHMLA_SPARSE, which serves fp8 as
fp8_ds_mla (656-byte rows). Each decoder layer also registers its DSA indexer
cache (132-byte rows).

Pristine LMCache 0.5.5 (and the series up to 0011) accepts the dict and
crashes on the first store: the default connector (V2) has one pointer slot
per model layer (kv_shape[0]) and is handed twice as many tensors.
"""

from __future__ import annotations

import pytest

from tests.lmcache import glm5_lmcache_run
from tests.lmcache.glm5_vllm_kv import INDEXER_BYTES, LATENT_BYTES
from tests.support.pcp_ranks import run_processes

pytestmark = pytest.mark.lmcache

GUARD = "0013-vllm-refuse-kv-cache-layers-lmcache-cannot-move.patch"

NUM_LAYERS = 2  # decoder layers of the tiny config
# A prompt of one full chunk and a partial one, at scattered blocks.
NUM_TOKENS = 300
BLOCK_IDS = [5, 2, 9, 11, 0]


def run_worker(tmp_path, variant: str) -> dict:
    (result,) = run_processes(
        1,
        glm5_lmcache_run.register_store_load,
        tmp_path,
        timeout_s=300,
        variant=variant,
        num_tokens=NUM_TOKENS,
        block_ids=BLOCK_IDS,
    )
    return result


@pytest.mark.parametrize(
    ("variant", "latent_bytes"), [("flashinfer_fp8", 576), ("flashmla_fp8_ds_mla", LATENT_BYTES)]
)
def test_vllm_registers_latent_and_indexer_caches_in_one_dict(tmp_path, variant, latent_bytes):
    from tests.lmcache.glm5_vllm_kv import build_glm5_kv_caches

    kv = build_glm5_kv_caches(tmp_path / "model", variant, num_hidden_layers=NUM_LAYERS)
    roles = {name: kv.role(name) for name in kv.kv_caches}
    assert sorted(roles.values()) == ["indexer"] * NUM_LAYERS + ["sparse"] * NUM_LAYERS
    for name, tensor in kv.kv_caches.items():
        width = INDEXER_BYTES if roles[name] == "indexer" else latent_bytes
        assert tensor.dim() == 4 and tuple(tensor.shape[1:]) == (1, 64, width), (name, tensor.shape)
        assert tensor.element_size() == 1
    # One group; both kinds of layer share one backing allocation.
    assert len(kv.kv_cache_config.kv_cache_groups) == 1
    assert len({t.untyped_storage().data_ptr() for t in kv.kv_caches.values()}) == 1


@pytest.mark.fixes(
    GUARD,
    fails_with=r"registration accepted.*could not broadcast input array from shape \(4,\) into shape \(2,\)",
)
@pytest.mark.parametrize("variant", ["flashinfer_fp8", "flashmla_fp8_ds_mla"])
def test_lmcache_refuses_layers_it_cannot_move_at_registration(tmp_path, variant):
    result = run_worker(tmp_path, variant)
    assert result["gpu_connector"] == "VLLMPagedMemGPUConnectorV2"
    assert result["kv_shape"][0] == NUM_LAYERS and result["kv_shape"][4] == 576
    if "register_error" not in result:
        pytest.fail(
            f"registration accepted {len(result['layers'])} layers "
            f"({result['row_bytes']}); the first store then raised "
            f"{result.get('store_error')}, the load {result.get('load_error')}, "
            f"bytes equal per layer: {result.get('equal')}"
        )
    error = result["register_error"]
    assert error["type"] == "UnsupportedKVCacheLayerError", error
    message = error["message"]
    for name, role in result["layers"].items():
        if role == "indexer":
            assert f"{name}: a DSA indexer cache" in message
            assert "cache_role=indexer" in message
        elif result["row_bytes"][name] != 576:
            assert f"{name}: rows of {LATENT_BYTES} bytes per token, but the connector moves 576" in message
            assert "cache_dtype_str=fp8_ds_mla" in message
        else:
            assert f"{name}:" not in message, "a latent layer of the connector's width was refused"
