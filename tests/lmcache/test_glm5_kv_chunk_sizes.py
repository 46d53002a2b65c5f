"""GLM-5.3 FP8's chunk as every consumer on the store and load path sizes
it, under the V3 connector's two layer groups (issue 15).

``metadata.kv_shape`` still describes one 576-wide MLA group (LMCache's
vLLM adapter builds it before any KV cache is registered); the chunk the V3
connector moves has both parts: per token and layer the latent row (576, or
656 with fp8_ds_mla) on every layer, and the DSA indexer's 132 bytes on the
layers that run it. At GLM-5.3's 78 decoder layers, 21 of them with an
indexer, a 256-token chunk is 256 x (78 x 576 + 21 x 132) = 12,211,200 B
(13,808,640 B with fp8_ds_mla), kv-sizing's figure. The worker is the one of test_glm5_kv_roundtrip.py (vLLM
0.31.0's own spec, grouping and allocation; see glm5_lmcache_run.py for what
stands in for CUDA), with a remote store (the FS connector on a real
directory) so that a remote connector is built as post_init builds it.
"""

from __future__ import annotations

import pytest

from tests.lmcache import glm5_lmcache_run
from tests.lmcache.glm5_vllm_kv import indexer_layers, kvsizing_geometry
from tests.lmcache.test_glm5_kv_roundtrip import VARIANTS
from tests.support.pcp_ranks import run_processes

pytestmark = pytest.mark.lmcache

CHUNK = glm5_lmcache_run.CHUNK_SIZE
LAYERS = 78
PATCH = "0020-local-cpu-backend-size-a-full-chunk-from-the-layer-groups.patch"

# Without the fix the local CPU backend sizes a chunk from kv_shape: one
# 576-wide group, 256 x 78 x 576 = 11,501,568 B, whatever the rows' width.
WITHOUT_FIX = r"the local CPU backend's full chunk is 11501568 B, not (12211200|13808640)"


@pytest.mark.fixes(PATCH, fails_with=WITHOUT_FIX)
@pytest.mark.parametrize(("variant", "latent_bytes"), VARIANTS)
def test_every_consumer_sizes_the_two_group_chunk(tmp_path, variant, latent_bytes):
    (sizes,) = run_processes(
        1,
        glm5_lmcache_run.chunk_sizes,
        tmp_path,
        timeout_s=300,
        variant=variant,
        num_layers=LAYERS,
        lmcache_env={"LMCACHE_REMOTE_URL": f"fs://host:0/{tmp_path / 'fs'}", "LMCACHE_REMOTE_SERDE": "naive"},
    )
    assert "register_error" not in sizes, sizes["register_error"]
    indexers = len(indexer_layers(LAYERS))
    assert indexers == 21
    chunk = CHUNK * (LAYERS * latent_bytes + indexers * 132)
    assert chunk == {576: 12_211_200, 656: 13_808_640}[latent_bytes]
    geometry = kvsizing_geometry()
    assert chunk == {576: geometry.CHUNK_BYTES, 656: geometry.FP8_DS_MLA_CHUNK_BYTES}[latent_bytes]
    assert sizes["kv_shape"] == [LAYERS, 1, CHUNK, 1, 576]  # the legacy single group
    assert sizes["memory_object"] == chunk, sizes
    assert sizes["metadata_shapes"] == chunk, sizes
    assert sizes["remote_full_chunk"] == chunk, sizes
    assert sizes["remote_token_bytes"] == LAYERS * latent_bytes + indexers * 132, sizes
    assert sizes["local_cpu_full_chunk"] == chunk, (
        f"the local CPU backend's full chunk is {sizes['local_cpu_full_chunk']} B, not {chunk}")
    align = sizes["allocator_align"]
    aligned = -(-chunk // align) * align
    assert sizes["local_cpu_chunk_budget"] == sizes["local_cpu_bytes"] // aligned, sizes
