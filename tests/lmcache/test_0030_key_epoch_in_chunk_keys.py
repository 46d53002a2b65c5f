"""Proof of 0030: a chunk key names the key epoch its engine was given.

0028's kv_layout tag keeps engines of two chunk layouts apart, but two builds of
one layout (other kernels, another LMCache patch series, another FlashInfer)
still compute one key for a chunk whose bytes may differ. Pods of two images
sharing one Valkey, as during an upgrade, then load each other's chunks as
their own and overwrite them. 0030 adds ``kv_key_epoch`` to LMCache's config
(``LMCACHE_KV_KEY_EPOCH``, which the image sets to its build's epoch): every
chunk key carries it, so engines of two epochs never see each other's chunks,
and engines of one epoch share them as before.

Real parts, as 0028's proof has them: vLLM 0.31.0 builds the KV caches and
specs with GLM-5.3's layer pattern (tests/lmcache/glm5_vllm_kv.py), LMCache's
adapter registers them through vLLM's LMCacheConnectorV1 with the V3
connector, the remote tier is a real Valkey, and each engine is a fresh
process (its L1 empty). Both engines have one layout (FlashInfer's ``fp8``
rows), so only the epoch tells their chunks apart.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.lmcache import glm5_lmcache_run
from tests.lmcache.test_0028_kv_layout_in_chunk_keys import CHUNKS_PER_ENGINE, LAYOUTS, run_engine
from tests.lmcache.test_glm5_kv_roundtrip import REMOTE_CASES, VARIANTS, check_case, valkey_env
from tests.support.pcp_ranks import run_processes

pytestmark = pytest.mark.lmcache

PATCH = "0030-name-the-key-epoch-in-chunk-keys.patch"
SHARED = r"engines of two key epochs share chunks in Valkey"

VARIANT, LATENT = VARIANTS[0]   # one layout for every engine here: flashinfer_fp8
LAYOUT = LAYOUTS[LATENT]
# Two builds' epochs, of the form the image derives (imagectl/keyepoch.py).
EPOCH_A, EPOCH_B = "3f9a07c2e1d4", "b81c55e0a9f7"
EPOCH_TAG = "@kv_key_epoch%"


def epoch_env(valkey, epoch: str | None) -> dict[str, str]:
    env = valkey_env(valkey)
    if epoch is not None:
        env["LMCACHE_KV_KEY_EPOCH"] = epoch
    return env


def held_keys(valkey) -> list[str]:
    return sorted(key.decode() for key in valkey.client().keys("*"))


def stored(tmp_path: Path, name: str, env: dict[str, str]) -> None:
    result = run_engine(tmp_path, name, VARIANT, "store", env)
    for case in result["cases"]:
        assert "store_error" not in case, case["store_error"]
    assert result["remote_holds_all"], result["backends"]


@pytest.mark.fixes(PATCH, fails_with=SHARED)
def test_engines_of_two_epochs_share_one_valkey_and_each_keeps_its_own_chunks(tmp_path, valkey):
    stored(tmp_path, "a-store", epoch_env(valkey, EPOCH_A))
    after_a = held_keys(valkey)
    assert len(after_a) == CHUNKS_PER_ENGINE, after_a
    # The engine of the other epoch, started after it, finds none of them: a cold start.
    loaded = run_engine(tmp_path, "b-load-cold", VARIANT, "load", epoch_env(valkey, EPOCH_B))
    found = {case["num_tokens"]: case.get("loaded_end", case.get("load_error")) for case in loaded["cases"]}
    assert all(end == 0 for end in found.values()), (
        f"{SHARED}: the engine of epoch {EPOCH_B} loaded {found} (prompt tokens: tokens loaded) of the chunks "
        f"the engine of epoch {EPOCH_A} stored, as its own")
    stored(tmp_path, "b-store", epoch_env(valkey, EPOCH_B))
    held = held_keys(valkey)
    epochs = Counter(key.rpartition(EPOCH_TAG)[2] if EPOCH_TAG in key else None for key in held)
    assert epochs == {EPOCH_A: CHUNKS_PER_ENGINE, EPOCH_B: CHUNKS_PER_ENGINE}, (
        f"{SHARED}: Valkey holds {dict(epochs)} chunks by key epoch after both stored, not {CHUNKS_PER_ENGINE} "
        f"of each: the second engine's stores replaced the first's under the same keys")
    # Every key names the layout, then the epoch; the first engine's keys are still there.
    for key in held:
        assert key.endswith((f"@kv_layout%{LAYOUT}{EPOCH_TAG}{EPOCH_A}",
                             f"@kv_layout%{LAYOUT}{EPOCH_TAG}{EPOCH_B}")), key
    assert set(after_a) <= set(held)
    # An engine of either epoch, restarted, loads its own chunks byte for byte: one epoch, one key space.
    for name, epoch in (("a-load", EPOCH_A), ("b-load", EPOCH_B)):
        for case in run_engine(tmp_path, name, VARIANT, "load", epoch_env(valkey, epoch))["cases"]:
            check_case(case)


@pytest.mark.parametrize("epoch", [None, ""], ids=["unset", "empty"])
def test_without_an_epoch_keys_stay_as_they_were(tmp_path, valkey, epoch):
    """No epoch (unset, or set empty: how an operator opts out of the image's) leaves 0028's keys
    as they were: the engine shares chunks with an engine of an image from before 0030."""
    stored(tmp_path, "store", epoch_env(valkey, epoch))
    held = held_keys(valkey)
    assert len(held) == CHUNKS_PER_ENGINE
    for key in held:
        assert key.endswith(f"@kv_layout%{LAYOUT}") and EPOCH_TAG not in key, key
    for case in run_engine(tmp_path, "load", VARIANT, "load", epoch_env(valkey, None))["cases"]:
        check_case(case)


@pytest.mark.parametrize("bad", ["cell@a", "builds/3f9a", "50%", "-3f9a", "x" * 65])
def test_an_epoch_a_key_cannot_carry_stops_the_engine_naming_it(tmp_path, bad):
    """The engine does not start with an epoch that would corrupt its keys' string form
    ('@' separates a key's fields, '%' a tag's name and value), naming the value."""
    env = {"LMCACHE_KV_KEY_EPOCH": bad}
    with pytest.raises(AssertionError) as raised:
        run_processes(1, glm5_lmcache_run.round_trip, tmp_path / "engine", timeout_s=300, variant=VARIANT,
                      phase="store", lmcache_env=env, cases=REMOTE_CASES[:1], store_blocks=[0, 1, 2, 3, 4],
                      load_blocks=[5, 6, 7, 8, 9], model_dir=str(tmp_path / "model"))
    assert f"ValueError: kv_key_epoch {bad!r} cannot be part of a chunk key" in str(raised.value)
