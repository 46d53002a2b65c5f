"""Proof of 0028: a chunk key names the chunk's layout.

Two prefill engines of one model can lay a chunk out differently: vLLM's
sparse FlashMLA backend keeps ``fp8_ds_mla`` latent rows of 656 bytes where
FlashInfer's ``fp8`` rows are 576, both ``uint8``, so LMCache's key
(model, world size, worker, chunk hash, dtype) is the same for both. Pods of
two builds or backends sharing one Valkey, as during a rolling upgrade, then
find each other's chunks: the lookup counts a hit, the GET of the other size
fails, and each engine's store overwrites the other's chunk under the shared
key, so neither keeps its cache.

Real parts: vLLM 0.31.0 builds both engines' KV caches and specs with
GLM-5.3's layer pattern (8 latent and 3 DSA indexer layers,
tests/lmcache/glm5_vllm_kv.py), LMCache's adapter registers them through
vLLM's LMCacheConnectorV1 with the V3 connector, and the remote tier is a real
Valkey. Each engine stores the same prompts, then each is restarted (a fresh
process, its L1 empty) and loads them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.lmcache import glm5_lmcache_run
from tests.lmcache.glm5_vllm_kv import token_bytes
from tests.lmcache.test_glm5_kv_roundtrip import (
    REMOTE_CASES,
    REMOTE_LOAD_BLOCKS,
    REMOTE_STORE_BLOCKS,
    VARIANTS,
    check_case,
    check_registered,
    valkey_env,
)
from tests.support.pcp_ranks import run_processes

pytestmark = pytest.mark.lmcache

PATCH = "0028-vllm-name-the-kv-layout-in-chunk-keys.patch"
SHARED_KEYS = r"engines of two chunk layouts share keys in Valkey"

CHUNK = glm5_lmcache_run.CHUNK_SIZE
CHUNKS_PER_ENGINE = sum(case["num_tokens"] // CHUNK for case in REMOTE_CASES)
# vLLM's specs for GLM-5.3's pattern at 8 layers: 3 indexer caches of 132 bytes
# per token, 8 latent caches of 576 (fp8) or 656 (fp8_ds_mla).
LAYOUTS = {576: "indexer132x3+mla576x8", 656: "indexer132x3+mla656x8"}


def run_engine(tmp_path: Path, name: str, variant: str, phase: str, env: dict[str, str]) -> dict:
    workdir = tmp_path / name
    workdir.mkdir()
    # One model directory for both: the model name is part of every chunk's key.
    (result,) = run_processes(1, glm5_lmcache_run.round_trip, workdir, timeout_s=300, variant=variant,
                              phase=phase, lmcache_env=env, cases=REMOTE_CASES, store_blocks=REMOTE_STORE_BLOCKS,
                              load_blocks=REMOTE_LOAD_BLOCKS, model_dir=str(tmp_path / "model"))
    check_registered(result)
    return result


@pytest.mark.fixes(PATCH, fails_with=SHARED_KEYS)
def test_engines_of_two_layouts_share_one_valkey_and_each_keeps_its_own_chunks(tmp_path, valkey):
    env = valkey_env(valkey)
    for variant, _ in VARIANTS:
        stored = run_engine(tmp_path, f"{variant}-store", variant, "store", env)
        for case in stored["cases"]:
            assert "store_error" not in case, case["store_error"]
        assert stored["remote_holds_all"], stored["backends"]
    client = valkey.client()
    held = {key.decode(): client.strlen(key) for key in client.keys("*")}
    sizes = Counter(held.values())
    want = {CHUNK * token_bytes(latent): CHUNKS_PER_ENGINE for _, latent in VARIANTS}
    assert sizes == want, (
        f"{SHARED_KEYS}: Valkey holds {dict(sizes)} (chunk bytes: count) after both stored, not "
        f"{CHUNKS_PER_ENGINE} chunks of each layout {want}: the second engine's stores replaced the first's "
        f"under the same keys")
    # Every key names its chunk's layout, and the size matches the name.
    layout_of_size = {CHUNK * token_bytes(latent): layout for latent, layout in LAYOUTS.items()}
    for key, size in held.items():
        assert key.endswith(f"@kv_layout%{layout_of_size[size]}"), key
    # Each engine, restarted, loads its own chunks byte for byte.
    for variant, _ in VARIANTS:
        loaded = run_engine(tmp_path, f"{variant}-load", variant, "load", env)
        for case in loaded["cases"]:
            check_case(case)
