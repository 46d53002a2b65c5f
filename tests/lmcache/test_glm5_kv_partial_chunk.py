"""GLM-5's partial last chunk through a remote store that keeps unfull
chunks, byte for byte (issue 15).

A remote connector that stores a prompt's partial last chunk without chunk
metadata (LMCache's FS connector with ``save_chunk_meta`` off, here on a real
directory) reads it back into a full-chunk memory object and narrows it to
the bytes it read (``RemoteConnector.reshape_partial_chunk``); with the
metadata kept it allocates the stored shapes instead. Under the V3 connector
GLM-5's memory object has two parts, the indexer pages and the latent rows
(one kernel group each: 3 and 8 layers with GLM-5.3's pattern), stored as the
first group's tokens, then the second's. The worker is the one of test_glm5_kv_roundtrip.py (vLLM 0.31.0's
own spec, grouping and allocation; see glm5_lmcache_run.py for what stands
in for CUDA); the load runs in a fresh process (an engine restart: L1
empty), for prompts of 300 and 130 tokens (neither a multiple of 64 or 256)
and for vLLM holding the prompt's first chunk (only the partial one is
read).
"""

from __future__ import annotations

import json

import pytest

from tests.lmcache import glm5_lmcache_run
from tests.lmcache.glm5_vllm_kv import token_bytes
from tests.lmcache.test_glm5_kv_roundtrip import (
    LOAD_BLOCKS,
    STORE_BLOCKS,
    V3_GROUPS,
    VARIANTS,
    WITHOUT_V3_GROUPS,
    check_case,
    check_groups,
    check_registered,
)
from tests.support.pcp_ranks import run_processes

pytestmark = pytest.mark.lmcache

CHUNK = glm5_lmcache_run.CHUNK_SIZE
PATCH = "0021-remote-connector-reshape-a-partial-chunk-of-every-layer-group.patch"

# Without the fix the narrowed object keeps every group's full-chunk shape
# (256 tokens) over the bytes read (44 tokens x (8 x 576 + 3 x 132) bytes),
# and the load raises on the first group (the indexer's 3 layers): viewing
# 220,176 bytes as 256 tokens, or, with fp8_ds_mla, the fallback copy
# indexing a 256-token view with the 44 tokens' mask.
WITHOUT_FIX = (r"the load raised (RuntimeError: shape '\[1, 3, 256, 132\]' is invalid for input of size 220176"
               r"|IndexError: The shape of the mask \[44\] at index 0 does not match the shape of the "
               r"indexed tensor \[256, 132\])")

CASES = [
    {"num_tokens": 300, "vllm_cached_tokens": 0},
    {"num_tokens": 300, "vllm_cached_tokens": 256},
    {"num_tokens": 130, "vllm_cached_tokens": 0},
]


def run(tmp_path, phase: str, variant: str, env: dict) -> dict:
    (result,) = run_processes(
        1,
        glm5_lmcache_run.round_trip,
        tmp_path / phase,
        timeout_s=300,
        variant=variant,
        cases=CASES,
        store_blocks=STORE_BLOCKS,
        load_blocks=LOAD_BLOCKS,
        phase=phase,
        lmcache_env=env,
        model_dir=str(tmp_path / "model"),  # the model name is part of every key
    )
    return result


def fs_env(tmp_path, save_chunk_meta: bool) -> dict:
    return {
        "LMCACHE_REMOTE_URL": f"fs://host:0/{tmp_path / 'fs'}",
        "LMCACHE_REMOTE_SERDE": "naive",
        "LMCACHE_SAVE_UNFULL_CHUNK": "True",
        "LMCACHE_EXTRA_CONFIG": json.dumps({"save_chunk_meta": save_chunk_meta}),
    }


def store_then_load_in_a_fresh_process(tmp_path, variant, latent_bytes, env, with_meta: bool) -> None:
    stored = run(tmp_path, "store", variant, env)
    check_registered(stored)
    check_groups(stored, latent_bytes)
    for case in stored["cases"]:
        assert "store_error" not in case, case["store_error"]
    assert stored["remote_holds_all"], stored["backends"]
    # Each stored file holds one chunk's tokens of both parts (after a
    # header of one size, when the metadata is kept), and nothing else.
    sizes = sorted(path.stat().st_size for path in (tmp_path / "fs").rglob("*.data"))
    row = token_bytes(latent_bytes)  # 8 latent rows and 3 indexer rows
    data = sorted([44 * row, 44 * row, 130 * row, CHUNK * row, CHUNK * row])
    headers = {size - want for size, want in zip(sizes, data, strict=True)}
    assert len(headers) == 1 and (headers.pop() > 0) == with_meta, (sizes, data)
    loaded = run(tmp_path, "load", variant, env)
    check_registered(loaded)
    for case in loaded["cases"]:
        error = case.get("load_error")
        assert error is None, f"{case['num_tokens']} tokens: the load raised {error['type']}: {error['message']}"
        check_case(case)


@pytest.mark.fixes(PATCH, fails_with=WITHOUT_FIX)
@pytest.mark.parametrize(("variant", "latent_bytes"), VARIANTS)
def test_partial_chunk_through_a_store_without_chunk_metadata(tmp_path, variant, latent_bytes):
    store_then_load_in_a_fresh_process(tmp_path, variant, latent_bytes, fs_env(tmp_path, False), with_meta=False)


# With its metadata kept, the connector allocates the stored shapes (both
# groups' of the partial chunk) instead of narrowing a full chunk.
@pytest.mark.fixes(V3_GROUPS, fails_with=WITHOUT_V3_GROUPS)
@pytest.mark.parametrize(("variant", "latent_bytes"), VARIANTS)
def test_partial_chunk_through_a_store_with_chunk_metadata(tmp_path, variant, latent_bytes):
    store_then_load_in_a_fresh_process(tmp_path, variant, latent_bytes, fs_env(tmp_path, True), with_meta=True)
