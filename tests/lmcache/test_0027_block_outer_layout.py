"""Proof of 0027: a block-outer KV cache layout is refused at registration.

vLLM 0.31.0 lays the KV cache out block-outer when asked
(``VLLM_KV_CACHE_LAYOUT=BLHNC``): one pool of blocks, each holding every
layer's page, so each layer's view steps over the other layers' pages from one
block to the next. vLLM builds the dict here with its own layout, spec and
allocation code (glm5_vllm_kv.py) and hands it to LMCache's real adapter with
the V3 connector, as test_glm5_kv_roundtrip.py does with vLLM's default layout
(LBNHC).

LMCache's MLA latent and DSA indexer copies address a token at
``slot * row`` from the layer's base pointer: the CUDA kernels of both formats
and the torch fallback that runs here alike. Without the guard the
registration is accepted, the store and the load raise nothing, and every
token of every layer comes back wrong. With it the registration is refused,
naming each layer's page stride and the layouts to run instead.
"""

from __future__ import annotations

import re

import pytest

from tests.lmcache import glm5_lmcache_run
from tests.lmcache.glm5_vllm_kv import INDEXER_BYTES, NUM_LAYERS, indexer_layers
from tests.support.pcp_ranks import run_processes

pytestmark = pytest.mark.lmcache

GUARD = "0027-vllm-refuse-mla-kv-cache-views-whose-pages-do-not-follow-one-another.patch"
BLOCK_SIZE = 64


def round_trip(tmp_path, variant: str) -> dict:
    (result,) = run_processes(
        1,
        glm5_lmcache_run.round_trip,
        tmp_path,
        timeout_s=300,
        variant=variant,
        cases=[{"num_tokens": 300, "vllm_cached_tokens": 0}],
        store_blocks=[5, 2, 9, 11, 0],
        load_blocks=[7, 13, 1, 20, 4],
        # read by vLLM's layout resolution in the worker, as an engine reads it
        lmcache_env={"VLLM_KV_CACHE_LAYOUT": "BLHNC"},
    )
    return result


@pytest.mark.fixes(GUARD, fails_with=r"registration did not refuse the block-outer layout")
@pytest.mark.parametrize(("variant", "latent_bytes"), [("flashinfer_fp8", 576), ("flashmla_fp8_ds_mla", 656)])
def test_block_outer_layout_is_refused_at_registration(tmp_path, variant, latent_bytes):
    result = round_trip(tmp_path, variant)
    assert result["layout"] == "BLHNC"
    error = result.get("register_error")
    if error is None or error["type"] != "UnsupportedKVCacheLayerError":
        (case,) = result.get("cases") or [{}]
        pytest.fail(
            f"registration did not refuse the block-outer layout ({error}); "
            f"tokens that came back wrong per layer: {case.get('mismatched_tokens')}, "
            f"store error {case.get('store_error')}, load error {case.get('load_error')}"
        )
    message = error["message"]
    indexers = indexer_layers()
    layers = NUM_LAYERS + len(indexers)
    assert f"cannot move {layers} of the {layers} KV cache layers" in message
    pages = {f"model.layers.{i}.self_attn.attn": BLOCK_SIZE * latent_bytes for i in range(NUM_LAYERS)}
    pages |= {f"model.layers.{i}.self_attn.indexer.k_cache": BLOCK_SIZE * INDEXER_BYTES for i in indexers}
    strides = set()
    for name, page in pages.items():
        found = re.search(rf"{re.escape(name)}: pages (\d+) bytes apart, but the copy kernels take one layer's "
                          rf"{page}-byte pages to follow one another", message)
        assert found, (name, message)
        strides.add(int(found.group(1)))
    # One block holds every layer's page (vLLM rounds it up to the pages' alignment).
    (stride,) = strides
    assert stride >= sum(pages.values())
    assert "run a layer-outer one (LBNHC, LBHNC)" in message
