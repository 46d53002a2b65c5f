"""GLM-5's KV cache as vLLM 0.31.0 registers it, through LMCache (issue 15).

vLLM builds the ``kv_caches`` dict with its own spec, layout, grouping and
allocation code (tests/lmcache/glm5_vllm_kv.py); a worker process hands it to
LMCache's real adapter through vLLM's ``LMCacheConnectorV1`` and stores and
loads a prompt (tests/lmcache/glm5_lmcache_run.py, which lists what stands in
for CUDA). Two backends are covered: FLASHINFER_MLA_SPARSE with fp8 (the
prefill preset: 576-byte latent rows) and FLASHMLA_SPARSE, which serves fp8 as
fp8_ds_mla (656-byte rows). The decoder layers that run the DSA indexer also
register its cache (132-byte rows): with GLM-5.3's pattern (index_topk_freq 4,
offset 2) 3 of the tiny model's 8 layers, as vLLM's own statements decide.

Pristine LMCache 0.5.5 (and the series up to 0011) accepts the dict and
crashes on the first store: the default connector (V2) has one pointer slot
per model layer (kv_shape[0], 8) and is handed 11 tensors. With the
series, V2 refuses it at registration and names ``use_gpu_connector_v3``,
which moves both kinds of layer (tests/lmcache/test_glm5_kv_roundtrip.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lmcache import glm5_lmcache_run
from tests.lmcache.glm5_vllm_kv import INDEXER_BYTES, LATENT_BYTES, NUM_LAYERS, indexer_layers
from tests.support.pcp_ranks import run_processes

pytestmark = pytest.mark.lmcache

GUARD = "0013-vllm-refuse-kv-cache-layers-lmcache-cannot-move.patch"

INDEXERS = indexer_layers()  # (0, 1, 5) of the tiny config's 8 decoder layers
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


_REGISTERED = """
import json, sys
from pathlib import Path
from tests.lmcache.glm5_vllm_kv import build_glm5_kv_caches
kv = build_glm5_kv_caches(Path(sys.argv[1]), sys.argv[2], num_hidden_layers=int(sys.argv[3]))
print(json.dumps({
    "layers": {name: [kv.role(name), list(t.shape), t.dim(), t.element_size()] for name, t in kv.kv_caches.items()},
    "groups": len(kv.kv_cache_config.kv_cache_groups),
    "storages": len({t.untyped_storage().data_ptr() for t in kv.kv_caches.values()}),
}))
"""


@pytest.mark.parametrize(
    ("variant", "latent_bytes"), [("flashinfer_fp8", 576), ("flashmla_fp8_ds_mla", LATENT_BYTES)]
)
def test_vllm_registers_latent_and_indexer_caches_in_one_dict(tmp_path, variant, latent_bytes):
    # In a fresh interpreter: vLLM keeps process-wide state (the config tests
    # before this one leave some) that changes the KV cache sizing.
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _REGISTERED, str(tmp_path / "model"), variant, str(NUM_LAYERS)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    kv = json.loads(done.stdout.strip().splitlines()[-1])
    roles = {name: layer[0] for name, layer in kv["layers"].items()}
    # A latent cache on every layer, an indexer cache where vLLM builds an indexer.
    assert roles == {
        **{f"model.layers.{i}.self_attn.indexer.k_cache": "indexer" for i in INDEXERS},
        **{f"model.layers.{i}.self_attn.attn": "sparse" for i in range(NUM_LAYERS)},
    }
    # The dict's order is the allocation's: the indexers, the latent caches of
    # the layers that run one, then the others'.
    names = list(roles)
    order = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in INDEXERS]
    order += [f"model.layers.{i}.self_attn.attn" for i in INDEXERS]
    order += [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS) if i not in INDEXERS]
    assert names == order
    for name, (role, shape, dim, element_size) in kv["layers"].items():
        width = INDEXER_BYTES if role == "indexer" else latent_bytes
        assert dim == 4 and tuple(shape[1:]) == (1, 64, width), (name, shape)
        assert element_size == 1
    # One group; both kinds of layer share one backing allocation.
    assert kv["groups"] == 1
    assert kv["storages"] == 1


@pytest.mark.fixes(
    GUARD,
    fails_with=r"registration accepted.*could not broadcast input array from shape \(11,\) into shape \(8,\)",
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
    # V2 cannot move two kinds of layer; the message names the connector that can.
    assert "set use_gpu_connector_v3: true" in message
    for name, role in result["layers"].items():
        if role == "indexer":
            assert f"{name}: a DSA indexer cache" in message
            assert "cache_role=indexer" in message
        elif result["row_bytes"][name] != 576:
            assert f"{name}: rows of {LATENT_BYTES} bytes per token, but the connector moves 576" in message
            assert "cache_dtype_str=fp8_ds_mla" in message
        else:
            assert f"{name}:" not in message, "a latent layer of the connector's width was refused"
