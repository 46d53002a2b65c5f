"""GLM-5's paged KV cache, built on CPU by vLLM 0.31.0's own code.

The ``kv_caches`` dict a worker hands to ``register_kv_caches``: each layer's
KV cache spec comes from the layer class's own ``get_kv_cache_spec`` (the
sparse MLA latent cache of ``MLAAttention`` and the DSA indexer cache of
``DeepseekV32IndexerCache``, adjusted by their backends' ``customize_spec``),
then vLLM's layout resolution, grouping (``get_kv_cache_configs``), kernel
block size selection and ``allocate_kv_cache`` build the tensors, as
``GPUModelRunner.initialize_kv_cache`` does.

Building the whole model is not possible here (no CUDA, no weights), so the
layer objects are replaced by namespaces that carry exactly the attributes the
two ``get_kv_cache_spec`` methods read, set as the layers' ``__init__`` sets
them for a ``glm_moe_dsa`` config. Everything from the specs on is vLLM's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

BLOCK_SIZE = 64
LATENT_HEAD_SIZE = 576  # kv_lora_rank 512 + qk_rope_head_dim 64
LATENT_BYTES = 656  # fp8_ds_mla: 512 fp8 + 4 fp32 scales + 64 bf16 rope
INDEXER_BYTES = 132  # index_head_dim 128 fp8 + one fp32 scale
INDEXER_HEAD_DIM = 128


def tiny_glm5_config(num_hidden_layers: int) -> dict[str, Any]:
    """A tiny ``GlmMoeDsaForCausalLM`` config with GLM-5's attention geometry."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "kv_lora_rank": 512,
        "q_lora_rank": 256,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 192,
        "v_head_dim": 256,
        "index_topk": 64,
        "index_head_dim": INDEXER_HEAD_DIM,
        "index_n_heads": 4,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }


def make_vllm_config(model_dir: Path, num_hidden_layers: int, cache_dtype: str):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig

    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(tiny_glm5_config(num_hidden_layers)))
    model_config = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, max_model_len=1024, dtype="bfloat16"
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype=cache_dtype),
        device_config=DeviceConfig(device="cpu"),
    )


def layer_specs(vllm_config, num_layers: int, backend: type, sm100: bool) -> dict[str, Any]:
    """Each layer's spec from the layer classes' own ``get_kv_cache_spec``, in
    the order the layers register in the forward context (a decoder layer's
    indexer cache is built before its MLA attention)."""
    import torch
    from vllm.model_executor.layers.attention.mla_attention import (
        MLAAttention,
        _canonicalize_sparse_mla_kv_cache_dtype,
    )
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

    cache_config = vllm_config.cache_config
    specs: dict[str, Any] = {}
    # B300 is SM103 (capability family 100): MLAAttention then aligns the
    # latent cache's block stride to its row size.
    original_family = current_platform.is_device_capability_family
    current_platform.is_device_capability_family = lambda family, *a, **k: sm100 and family == 100
    try:
        for i in range(num_layers):
            prefix = f"model.layers.{i}.self_attn"
            indexer = SimpleNamespace(
                cache_config=cache_config,
                head_dim=INDEXER_HEAD_DIM + INDEXER_HEAD_DIM // 128 * 4,
                dtype=torch.uint8,
            )
            spec = DeepseekV32IndexerCache.get_kv_cache_spec(indexer, vllm_config)
            specs[f"{prefix}.indexer.k_cache"] = DeepseekV32IndexerBackend.customize_spec(spec)
            attn = SimpleNamespace(
                kv_cache_dtype=_canonicalize_sparse_mla_kv_cache_dtype(
                    backend, cache_config.cache_dtype
                ),
                head_size=LATENT_HEAD_SIZE,
                sliding_window=None,
                indexer=indexer,
                non_causal_multi_token_decode=False,
                attn_backend=backend,
            )
            attn._uses_flat_kv_cache = lambda attn=attn: MLAAttention._uses_flat_kv_cache(attn)
            spec = MLAAttention.get_kv_cache_spec(attn, vllm_config)
            specs[f"{prefix}.attn"] = backend.customize_spec(spec)
    finally:
        current_platform.is_device_capability_family = original_family
    return specs


@dataclass
class Glm5KV:
    vllm_config: Any
    specs: dict[str, Any]
    kv_cache_config: Any
    layout: Any
    kv_caches: dict[str, Any]

    def role(self, name: str) -> str:
        return self.specs[name].cache_role.value


# The two sparse MLA backends vLLM 0.31.0 runs GLM-5 with on SM10x, and the KV
# cache dtype each is given. The prefill preset (configs/prefill/vllm.yaml)
# asks for FLASHINFER_MLA_SPARSE with kv-cache-dtype fp8: 576-byte latent rows.
# FLASHMLA_SPARSE turns fp8 into fp8_ds_mla: 656-byte rows.
BACKENDS = {
    "flashinfer_fp8": ("vllm.v1.attention.backends.mla.flashinfer_mla_sparse",
                       "FlashInferMLASparseTRTLLMBackend", "fp8", 576),
    "flashmla_fp8_ds_mla": ("vllm.v1.attention.backends.mla.flashmla_sparse",
                            "FlashMLASparseBackend", "fp8", LATENT_BYTES),
}


def build_glm5_kv_caches(
    model_dir: Path,
    variant: str = "flashmla_fp8_ds_mla",
    num_hidden_layers: int = 2,
    num_blocks: int = 24,
    sm100: bool = True,
    device: str = "cpu",
) -> Glm5KV:
    """The ``kv_caches`` dict vLLM registers for ``num_hidden_layers`` decoder
    layers (no MTP layer: the presets configure no speculative decoding),
    with about ``num_blocks`` blocks of 64 tokens, on ``device``."""
    import importlib

    import torch
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.worker.utils import allocate_kv_cache, select_common_block_size

    module, name, cache_dtype, _ = BACKENDS[variant]
    backend = getattr(importlib.import_module(module), name)
    vllm_config = make_vllm_config(model_dir, num_hidden_layers, cache_dtype)
    specs = layer_specs(vllm_config, num_hidden_layers, backend, sm100)
    backends = [backend, DeepseekV32IndexerBackend]
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(vllm_config, [supported], specs.values())
    page_bytes = sum(spec.page_size_bytes for spec in specs.values())
    (kv_cache_config,) = get_kv_cache_configs(vllm_config, [specs], [page_bytes * num_blocks])
    kernel_block_sizes = [
        select_common_block_size(group.kv_cache_spec.block_size, backends)
        for group in kv_cache_config.kv_cache_groups
    ]
    kv_caches = allocate_kv_cache(kv_cache_config, torch.device(device), layout, kernel_block_sizes)
    return Glm5KV(vllm_config, specs, kv_cache_config, layout, kv_caches)
