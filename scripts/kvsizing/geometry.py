"""GLM-5.3 FP8's KV bytes per token, from the model's geometry and the presets' backend.

vLLM 0.31.0 with the prefill preset (FLASHINFER_MLA_SPARSE, kv-cache-dtype fp8)
registers two caches per decoder layer, one row per token each (README, "Facts
measured"; tests/lmcache/test_glm5_chunk_figure.py ties these numbers to vLLM's
own spec and allocation code):

- the MLA latent: kv_lora_rank 512 + qk_rope_head_dim 64, one fp8 byte each;
- the DSA indexer key: index_head_dim 128 fp8 values + one fp32 scale.

FLASHMLA_SPARSE serves the same dtype as fp8_ds_mla, 656-byte latent rows
(512 fp8 + 4 fp32 scales + 64 bf16 rope). An LMCache chunk that carries both
caches is the sum of the rows over every layer; no MTP layer is counted (the
presets configure no speculative decoding).

The write-up's "12.4 MB per 256-token chunk" fits the latent rows alone; it is
kept as WRITEUP_CHUNK_BYTES only to reproduce the write-up's own figures.
"""
from __future__ import annotations

LAYERS = 78  # GLM-5.3's decoder layers (num_hidden_layers), MTP excluded
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
INDEX_HEAD_DIM = 128
FP8_BYTES = 1
FP32_BYTES = 4
BF16_BYTES = 2

LATENT_ROW_BYTES = (KV_LORA_RANK + QK_ROPE_HEAD_DIM) * FP8_BYTES  # 576
FP8_DS_MLA_ROW_BYTES = (KV_LORA_RANK * FP8_BYTES + KV_LORA_RANK // 128 * FP32_BYTES  # one scale per 128 values
                        + QK_ROPE_HEAD_DIM * BF16_BYTES)  # 656
INDEXER_ROW_BYTES = INDEX_HEAD_DIM * FP8_BYTES + INDEX_HEAD_DIM // 128 * FP32_BYTES  # 132

# Per token and layer, the parts an LMCache chunk carries with the presets.
ROW_BYTES: tuple[int, ...] = (LATENT_ROW_BYTES, INDEXER_ROW_BYTES)
CHUNK_TOKENS = 256  # LMCache chunk_size (configs/prefill/lmcache.yaml)


def bytes_per_token(row_bytes: tuple[int, ...] = ROW_BYTES, layers: int = LAYERS) -> int:
    """KV bytes of one token over every layer: the sum of its rows per layer, times the layers."""
    return sum(row_bytes) * layers


KV_BYTES_PER_TOKEN = bytes_per_token()  # 708 x 78 = 55,224 B
CHUNK_BYTES = KV_BYTES_PER_TOKEN * CHUNK_TOKENS  # 14,137,344 B = 13.48 MiB
LATENT_CHUNK_BYTES = bytes_per_token((LATENT_ROW_BYTES,)) * CHUNK_TOKENS  # 11,501,568 B
FP8_DS_MLA_LATENT_CHUNK_BYTES = bytes_per_token((FP8_DS_MLA_ROW_BYTES,)) * CHUNK_TOKENS  # 13,099,008 B
WRITEUP_CHUNK_BYTES = 12_400_000  # the write-up's figure (latent only): its own runs only
