"""GLM-5's whole KV through LMCache's CUDA kernels, on a GPU machine without vLLM.

test_glm5_kv_roundtrip.py's GPU case needs vLLM, which the lent GPU machine
cannot have (tests/lmcache/gpu/README.md). Here the worker's registration is
replayed from what vLLM 0.31.0 and LMCache's adapter hand over, recorded in
glm5_handoff.json (tests/lmcache/glm5_handoff.py): the metadata of vLLM's
factory, the layout hints and each layer's role, and the ``kv_caches``
tensors' exact geometry, views into one shared allocation as vLLM's
``allocate_kv_cache`` lays them out. On CUDA the V3 connector's kernels
(``multi_layer_kv_transfer`` per kernel group: 576- or 656-byte latent rows,
and the indexer's blocked pages of 128 fp8 values then 4-byte scales) move
every byte; the checks are the round trip's own (glm5_lmcache_run._one_case):
every byte of every loaded token, vLLM's cached prefix untouched, the DSA
indexer's top-k on the restored cache. The recorded model has GLM-5.3's layer
pattern (8 latent caches, 3 indexer caches), so the two kernel groups differ
in layer count.

- the recording equals what vLLM and the adapter hand over now (CPU, vLLM);
- the replay round-trips on CPU through LMCache's torch fallback copies and
  imports no vLLM (it runs in the GPU bundle's rehearsal too);
- the replay round-trips on CUDA (gpu: run by tests/lmcache/gpu/device_run.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lmcache import glm5_handoff
from tests.lmcache.glm5_vllm_kv import indexer_layers
from tests.lmcache.test_glm5_kv_roundtrip import CASES, LOAD_BLOCKS, STORE_BLOCKS, check_case
from tests.support.pcp_ranks import run_processes

pytestmark = pytest.mark.lmcache

REPO = Path(__file__).resolve().parents[2]
V3_GROUPS = "0015-v3-gpu-connector-move-each-kernel-group-with-its-own-geometry.patch"
LATENT_BYTES = {"flashinfer_fp8": 576, "flashmla_fp8_ds_mla": 656}
# GLM-5.3's layer pattern on the recorded model: 8 latent caches, 3 indexer caches.
INDEXERS = indexer_layers(glm5_handoff.LAYERS)


def replayed(tmp_path, variant: str, device: str) -> dict:
    """The replay in a process of its own in which vLLM cannot be imported
    (LMCache's own modules import vLLM's when it is installed; on the GPU
    machine it is not)."""
    out = tmp_path / "replayed.json"
    spec = {"cases": CASES, "store_blocks": STORE_BLOCKS, "load_blocks": LOAD_BLOCKS}
    argv = [sys.executable, "-m", "tests.lmcache.glm5_handoff", "replay", variant, "--device", device,
            "--cases", json.dumps(spec), "--json", str(out)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    if done.returncode != 0:
        raise AssertionError(f"the replay ({variant}, {device}) exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def check_replayed(result: dict, variant: str) -> None:
    assert result["gpu_connector"] == "VLLMPagedMemGPUConnectorV3"
    assert len(result["cases"]) == len(CASES)
    for case in result["cases"]:
        check_case(case)
    assert result["groups"] == glm5_handoff.load_recorded()[variant]["kernel_groups"]
    # Two kernel groups of different layer counts: a group sized by the other's count fails the cases.
    assert sorted(result["groups"]) == [
        ["NL_X_NB_BSV_BSS", len(INDEXERS), 132], ["NL_X_NB_BS_HS", glm5_handoff.LAYERS, LATENT_BYTES[variant]]]
    assert len(INDEXERS) != glm5_handoff.LAYERS


@pytest.mark.parametrize("variant", glm5_handoff.VARIANTS)
def test_the_recorded_handoff_is_what_vllm_hands_lmcache_now(tmp_path, variant):
    (fresh,) = run_processes(1, glm5_handoff.record, tmp_path, timeout_s=300, variant=variant)
    recorded = glm5_handoff.load_recorded()[variant]
    assert fresh == recorded, (
        f"{glm5_handoff.HANDOFF_FILE.name}[{variant}] is stale: "
        "python -m tests.lmcache.glm5_handoff record --write"
    )
    # What makes the layout GLM-5.3's: a latent cache on each decoder layer,
    # an indexer cache on the layers that run the indexer (GLM-5.3's pattern),
    # views into one allocation, the roles from vLLM's specs.
    layers = recorded["kv_caches"]["layers"]
    latent = glm5_handoff.LAYERS
    assert [layer["shape"][-1] for layer in layers] == [132] * len(INDEXERS) + [LATENT_BYTES[variant]] * latent
    assert [layer["name"] for layer in layers][: len(INDEXERS)] == [
        f"model.layers.{i}.self_attn.indexer.k_cache" for i in INDEXERS]
    assert {layer["allocation"] for layer in layers} == {0}
    assert recorded["layout_hints"]["kv_cache_roles"] == ["indexer"] * len(INDEXERS) + ["mla"] * latent


@pytest.mark.fixes(V3_GROUPS, fails_with=r"size of tensor a \(\d+\) must match the size of tensor b \(132\)")
@pytest.mark.parametrize("variant", glm5_handoff.VARIANTS)
def test_the_replayed_handoff_round_trips_on_cpu_without_vllm(tmp_path, variant):
    check_replayed(replayed(tmp_path, variant, "cpu"), variant)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", glm5_handoff.VARIANTS)
def test_the_replayed_handoff_round_trips_through_lmcache_cuda_kernels(tmp_path, variant):
    result = replayed(tmp_path, variant, "cuda")
    assert result["kv_device"] == "cuda:0"
    check_replayed(result, variant)
