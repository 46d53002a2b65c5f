"""A model's KV bytes per token and per LMCache chunk, from its config.json, as vLLM 0.31.0 registers them.

vLLM 0.31.0 registers, for a DSA model (``glm_moe_dsa``: a config with
``index_topk``), one MLA latent cache on every decoder layer and a DSA indexer
cache only on the layers that run the indexer, one row per token each:

- the MLA latent: kv_lora_rank + qk_rope_head_dim values, one fp8 byte each
  with kv-cache-dtype fp8 (FLASHINFER_MLA_SPARSE, the presets: 576 B); with
  fp8_ds_mla (what FLASHMLA_SPARSE serves fp8 as) kv_lora_rank fp8 bytes, one
  fp32 scale per 128 of them and the rope part in bf16 (656 B);
- the DSA indexer key: index_head_dim fp8 values + one fp32 scale per 128 (132 B).

Which layers run the indexer is vLLM's rule (``DeepseekV2MLAAttention``'s
IndexCache block, restated here): with ``index_topk_pattern`` a layer runs
it unless its letter is "S"; otherwise layer i runs it when
max(i - index_skip_topk_offset + 1, 0) is a multiple of index_topk_freq
(defaults 1 and 2: every layer); an MTP layer (index num_hidden_layers and
up) always has one. tests/lmcache/test_glm5_chunk_figure.py checks this rule
against vLLM's own statements and these rows against the ``kv_caches`` vLLM's
own code allocates.

GLM-5.3 (glm-5.3-fp8.config.json beside this file, the KV geometry's keys of
its checkpoint config: 78 decoder layers, kv_lora_rank 512, qk_rope_head_dim
64, index_head_dim 128, index_topk_freq 4, index_skip_topk_offset 2) runs the
indexer on layers 0, 1, 5, 9, ..., 77: 78 latent + 21 indexer caches, the 99
KV cache layers vLLM's own tests name for GLM-5.3. An LMCache chunk carries
every cache's rows: 256 x (78 x 576 + 21 x 132) = 12,211,200 B with the
presets (13,808,640 B with fp8_ds_mla). No MTP layer is counted: the presets
configure no speculative decoding (``mtp_layers`` adds them).

The write-up's "about 12.4 MB per 256-token chunk" is within 1.5% of that
chunk; its bandwidths (0.78-0.89 GB/s for one instance, 8.9 ms per GET on
eight) were measured moving 12.4 MB chunks, so WRITEUP_CHUNK_BYTES stays
beside them wherever they are used.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

FP8_BYTES = 1
FP32_BYTES = 4
BF16_BYTES = 2
SCALE_GROUP = 128  # fp8 values per fp32 scale (fp8_ds_mla's latent, the DSA indexer key)
CACHE_DTYPES = ("fp8", "fp8_ds_mla")  # kv-cache-dtype as the sparse MLA backend keeps it
CHUNK_TOKENS = 256  # LMCache chunk_size (configs/prefill/lmcache.yaml)
MODEL_CONFIG = Path(__file__).with_name("glm-5.3-fp8.config.json")  # --model-config's default


class ConfigError(ValueError):
    """A config.json kv-sizing cannot read the KV geometry from."""


def load_config(path: Path = MODEL_CONFIG) -> dict:
    try:
        config = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return config


def _int_key(config: dict, key: str, default: Optional[int] = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"config.json: {key} must be a whole number >= 0, got {value!r}")
    return value


def indexer_layers(config: dict, mtp_layers: int = 0) -> Tuple[int, ...]:
    """The layers (decoder layers, then ``mtp_layers`` MTP layers) on which
    vLLM 0.31.0 builds a DSA indexer for this config (the rule in the module
    docstring)."""
    layers = _int_key(config, "num_hidden_layers")
    if "index_topk" not in config:  # not a DSA model: no indexer anywhere
        return ()
    pattern = config.get("index_topk_pattern")
    freq = _int_key(config, "index_topk_freq", 1)
    offset = _int_key(config, "index_skip_topk_offset", 2)
    if pattern is None and freq < 1:
        raise ConfigError(f"config.json: index_topk_freq must be >= 1, got {freq}")
    chosen = []
    for i in range(layers + mtp_layers):
        if i >= layers:
            runs = True  # an MTP layer always builds its indexer
        elif pattern is not None:
            runs = not (i < len(pattern) and pattern[i] == "S")
        else:
            runs = max(i - offset + 1, 0) % freq == 0
        if runs:
            chosen.append(i)
    return tuple(chosen)


@dataclass(frozen=True)
class KVGeometry:
    """What one token of a model occupies in vLLM's KV caches, and so in an LMCache chunk."""

    latent_layers: int  # every decoder (and MTP) layer has an MLA latent cache
    indexer_layers: Tuple[int, ...]  # the layers that also have a DSA indexer cache
    latent_row_bytes: int
    indexer_row_bytes: int
    cache_dtype: str

    @property
    def caches(self) -> int:
        return self.latent_layers + len(self.indexer_layers)

    @property
    def bytes_per_token(self) -> int:
        return self.latent_layers * self.latent_row_bytes + len(self.indexer_layers) * self.indexer_row_bytes

    def chunk_bytes(self, tokens: int = CHUNK_TOKENS) -> int:
        return self.bytes_per_token * tokens

    def describe(self) -> str:
        """'78 x 576 + 21 x 132 B' (latent rows, then indexer rows)."""
        text = f"{self.latent_layers} x {self.latent_row_bytes}"
        if self.indexer_layers:
            text += f" + {len(self.indexer_layers)} x {self.indexer_row_bytes}"
        return text + " B"


def from_config(config: dict, cache_dtype: str = "fp8", mtp_layers: int = 0) -> KVGeometry:
    """The KV geometry vLLM 0.31.0 registers for ``config`` (a config.json's
    mapping) with ``cache_dtype`` and ``mtp_layers`` MTP layers."""
    if cache_dtype not in CACHE_DTYPES:
        raise ConfigError(f"kv-cache-dtype {cache_dtype!r}: expected one of {', '.join(CACHE_DTYPES)}")
    if isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int) or mtp_layers < 0:
        raise ConfigError(f"mtp layers must be a whole number >= 0, got {mtp_layers!r}")
    layers = _int_key(config, "num_hidden_layers")
    kv_lora_rank = _int_key(config, "kv_lora_rank")
    rope = _int_key(config, "qk_rope_head_dim")
    if layers < 1 or kv_lora_rank < 1:
        raise ConfigError("config.json: not an MLA model (num_hidden_layers and kv_lora_rank must be >= 1)")
    if cache_dtype == "fp8":
        latent = (kv_lora_rank + rope) * FP8_BYTES
    else:
        latent = kv_lora_rank * FP8_BYTES + -(-kv_lora_rank // SCALE_GROUP) * FP32_BYTES + rope * BF16_BYTES
    index_dim = _int_key(config, "index_head_dim", 0)
    indexers = indexer_layers(config, mtp_layers)
    if indexers and index_dim < 1:
        raise ConfigError("config.json: a DSA model (index_topk) needs index_head_dim >= 1")
    indexer = index_dim * FP8_BYTES + -(-index_dim // SCALE_GROUP) * FP32_BYTES
    return KVGeometry(layers + mtp_layers, indexers, latent, indexer, cache_dtype)


def bytes_per_token(row_bytes: Tuple[int, ...], layers: int) -> int:
    """A uniform model's KV bytes of one token: every part's row on every layer."""
    return sum(row_bytes) * layers


GLM53_CONFIG = load_config()
GLM53 = from_config(GLM53_CONFIG)  # the presets: FLASHINFER_MLA_SPARSE, kv-cache-dtype fp8
GLM53_FP8_DS_MLA = from_config(GLM53_CONFIG, "fp8_ds_mla")  # FLASHMLA_SPARSE

LAYERS = GLM53.latent_layers  # 78
INDEXER_LAYERS = len(GLM53.indexer_layers)  # 21
LATENT_ROW_BYTES = GLM53.latent_row_bytes  # 576
FP8_DS_MLA_ROW_BYTES = GLM53_FP8_DS_MLA.latent_row_bytes  # 656
INDEXER_ROW_BYTES = GLM53.indexer_row_bytes  # 132
KV_BYTES_PER_TOKEN = GLM53.bytes_per_token  # 78 x 576 + 21 x 132 = 47,700 B
CHUNK_BYTES = GLM53.chunk_bytes()  # 12,211,200 B = 11.65 MiB
FP8_DS_MLA_CHUNK_BYTES = GLM53_FP8_DS_MLA.chunk_bytes()  # 78 x 656 + 21 x 132 = 53,940 B/token: 13,808,640 B
LATENT_CHUNK_BYTES = LAYERS * LATENT_ROW_BYTES * CHUNK_TOKENS  # 11,501,568 B: the latent rows alone
# The write-up's chunk, with which its bandwidths were measured (0.78-0.89 GB/s, 13.9-15.9 ms per GET on one
# instance; 8.9 ms per GET on eight): use those with this size, or as time per GET.
WRITEUP_CHUNK_BYTES = 12_400_000
