"""The chunk figure the project sizes with is the one vLLM 0.31.0 allocates for GLM-5 (issue 15).

vLLM's own spec, grouping and allocation code builds the ``kv_caches`` dict a
worker registers (tests/lmcache/glm5_vllm_kv.py, in a fresh interpreter as in
test_glm5_kv_layout.py); the bytes per token over both kinds of layer there
(the MLA latent cache and the DSA indexer cache of each decoder layer) must
be kv-sizing's constants (scripts/kvsizing/geometry.py), which every other
figure (the cost model, cellsim's defaults, the shard sizing) derives from.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from kvsizing import geometry  # noqa: E402

pytestmark = pytest.mark.lmcache

NUM_LAYERS = 3  # decoder layers of the tiny config: the figure is per layer

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


def per_token(tmp_path: Path, variant: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PER_TOKEN, str(tmp_path / "model"), variant, str(NUM_LAYERS)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("variant", "latent_row"), [
    ("flashinfer_fp8", geometry.LATENT_ROW_BYTES),  # the presets: FLASHINFER_MLA_SPARSE, kv-cache-dtype fp8
    ("flashmla_fp8_ds_mla", geometry.FP8_DS_MLA_ROW_BYTES),  # FLASHMLA_SPARSE: fp8 served as fp8_ds_mla
])
def test_vllm_allocates_the_bytes_per_token_kv_sizing_uses(tmp_path, variant, latent_row):
    kv = per_token(tmp_path, variant)
    layers = kv["layers"].values()
    roles = sorted(layer["role"] for layer in layers)
    assert roles == ["indexer"] * NUM_LAYERS + ["sparse"] * NUM_LAYERS
    for layer in layers:
        expected = geometry.INDEXER_ROW_BYTES if layer["role"] == "indexer" else latent_row
        assert layer["row_bytes"] == expected, layer
        # vLLM's page holds exactly these rows: no padding a chunk would have to carry or skip.
        assert layer["spec_bytes_per_token"] == expected, layer
    per_layer = sum(layer["row_bytes"] for layer in layers) / NUM_LAYERS
    assert per_layer == latent_row + geometry.INDEXER_ROW_BYTES
    if variant == "flashinfer_fp8":
        # The tool's constant: the presets' bytes per token over both kinds of layer, at 78 layers.
        assert per_layer == sum(geometry.ROW_BYTES)
        assert per_layer * geometry.LAYERS == geometry.KV_BYTES_PER_TOKEN == 55_224
        assert per_layer * geometry.LAYERS * geometry.CHUNK_TOKENS == geometry.CHUNK_BYTES == 14_137_344
