"""The chunk figure the project sizes with is the one vLLM 0.31.0 allocates for GLM-5.3 (issue 15).

kv-sizing (scripts/kvsizing/geometry.py) reads GLM-5.3's config
(scripts/kvsizing/glm-5.3-fp8.config.json) and states vLLM's rule for which
layers run the DSA indexer; every other figure (the cost model, cellsim's
defaults, the shard sizing) derives from it. Here vLLM decides:

- which layers build an indexer: the IndexCache statements of vLLM's
  ``DeepseekV2MLAAttention.__init__``, run on the config as vLLM loads it
  (glm5_vllm_kv.vllm_builds_indexer), for GLM-5.3's config, the tiny
  model's, MTP layers, and configs that set the pattern otherwise;
- the bytes per token: vLLM's own spec, grouping and allocation code builds
  the ``kv_caches`` dict a worker registers for a model with GLM-5.3's KV
  geometry and all 78 of its layers (glm5_vllm_kv.py, in a fresh interpreter
  as in test_glm5_kv_layout.py); the rows over every cache there must be
  kv-sizing's figure: 256 x (78 x 576 + 21 x 132) = 12,211,200 B per chunk
  with the presets, 13,808,640 B with fp8_ds_mla.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lmcache.glm5_vllm_kv import glm53_config, kvsizing_geometry, tiny_glm5_config

geometry = kvsizing_geometry()

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.lmcache

GLM53_LAYERS = 78

_PER_TOKEN = """
import json, sys
from pathlib import Path
from tests.lmcache.glm5_vllm_kv import BLOCK_SIZE, build_glm5_kv_caches
kv = build_glm5_kv_caches(Path(sys.argv[1]), sys.argv[2], num_hidden_layers=int(sys.argv[3]))
layers = {}
for name, t in kv.kv_caches.items():
    spec = kv.specs[name]
    layers[name] = {
        "role": kv.role(name),
        # one token's row in the tensor vLLM hands to register_kv_caches
        "row_bytes": t.shape[-1] * t.element_size(),
        "block_tokens": t.shape[-2],
        # vLLM's own page size per token of the layer's spec
        "spec_bytes_per_token": spec.page_size_bytes / spec.block_size,
    }
print(json.dumps({"layers": layers, "block_size": BLOCK_SIZE}))
"""


def per_token(tmp_path: Path, variant: str, num_layers: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _PER_TOKEN, str(tmp_path / "model"), variant, str(num_layers)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("variant", "cache_dtype", "chunk"), [
    # the presets: FLASHINFER_MLA_SPARSE, kv-cache-dtype fp8
    ("flashinfer_fp8", "fp8", 12_211_200),
    # FLASHMLA_SPARSE: fp8 served as fp8_ds_mla
    ("flashmla_fp8_ds_mla", "fp8_ds_mla", 13_808_640),
])
def test_vllm_allocates_the_bytes_per_token_kv_sizing_uses(tmp_path, variant, cache_dtype, chunk):
    glm53 = geometry.from_config(geometry.GLM53_CONFIG, cache_dtype)
    kv = per_token(tmp_path, variant, GLM53_LAYERS)
    layers = kv["layers"]
    roles = [layer["role"] for layer in layers.values()]
    # 99 KV cache layers: a latent cache on every layer, an indexer cache on 21.
    assert (roles.count("sparse"), roles.count("indexer"), len(roles)) == (78, 21, 99)
    indexers = sorted(int(name.split(".")[2]) for name, layer in layers.items() if layer["role"] == "indexer")
    assert tuple(indexers) == glm53.indexer_layers == (0, 1, *range(5, 78, 4))
    for layer in layers.values():
        expected = glm53.indexer_row_bytes if layer["role"] == "indexer" else glm53.latent_row_bytes
        assert layer["row_bytes"] == expected, layer
        # vLLM's page holds exactly these rows: no padding a chunk would have to carry or skip.
        assert layer["spec_bytes_per_token"] == expected, layer
    per_token_bytes = sum(layer["row_bytes"] for layer in layers.values())
    assert per_token_bytes == glm53.bytes_per_token
    assert per_token_bytes * geometry.CHUNK_TOKENS == glm53.chunk_bytes() == chunk
    if variant == "flashinfer_fp8":
        # The tool's constants: the presets' bytes per token and chunk.
        assert per_token_bytes == geometry.KV_BYTES_PER_TOKEN == 47_700
        assert per_token_bytes * geometry.CHUNK_TOKENS == geometry.CHUNK_BYTES == 12_211_200
    else:
        assert per_token_bytes * geometry.CHUNK_TOKENS == geometry.FP8_DS_MLA_CHUNK_BYTES


_DECISIONS = """
import json, sys
from pathlib import Path
from vllm.config import ModelConfig
from tests.lmcache.glm5_vllm_kv import vllm_builds_indexer
out = {}
for name, path, layers in json.loads(sys.argv[1]):
    hf_config = ModelConfig(model=path, skip_tokenizer_init=True, max_model_len=1024, dtype="bfloat16").hf_config
    out[name] = [i for i, runs in enumerate(vllm_builds_indexer(hf_config, list(range(layers)))) if runs]
print(json.dumps(out))
"""


def test_vllm_decides_the_indexer_layers_as_kv_sizing_does(tmp_path):
    """vLLM's own statements and kv-sizing's rule give the same layers, for
    each config and with one MTP layer after the decoder layers."""
    tiny = tiny_glm5_config(8)
    glm53 = {**tiny, **glm53_config()}  # GLM-5.3's KV keys and 78 layers, loadable without its weights
    configs = {
        "glm-5.3": glm53,
        "tiny-8": tiny,
        "tiny-13-offset-0": {**tiny_glm5_config(13), "index_skip_topk_offset": 0},
        "tiny-6-pattern": {**tiny_glm5_config(6), "index_topk_pattern": "FSSFS"},  # shorter than the layers
        "tiny-5-every-layer": {k: v for k, v in tiny_glm5_config(5).items()
                               if k not in ("index_topk_freq", "index_skip_topk_offset")},
    }
    runs = []
    for name, config in configs.items():
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        runs.append([name, str(path), config["num_hidden_layers"] + 1])  # and one MTP layer
    done = subprocess.run([sys.executable, "-c", _DECISIONS, json.dumps(runs)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    decided = json.loads(done.stdout.strip().splitlines()[-1])
    for name, config in configs.items():
        assert decided[name] == list(geometry.indexer_layers(config, mtp_layers=1)), name
    # GLM-5.3: layers 0, 1, 5, 9, ..., 77 (21), and the MTP layer 78.
    assert decided["glm-5.3"] == [0, 1, *range(5, 78, 4), 78]
    assert decided["tiny-8"] == [0, 1, 5, 8]
    assert decided["tiny-6-pattern"] == [0, 3, 5, 6]
    assert decided["tiny-5-every-layer"] == [0, 1, 2, 3, 4, 5]
