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

Which layers carry a DSA indexer is vLLM's decision too: GLM-5.3's config
(scripts/kvsizing/glm-5.3-fp8.config.json, the one place the project keeps
its layer pattern) sets ``index_topk_freq`` 4 and ``index_skip_topk_offset``
2, and ``DeepseekV2MLAAttention`` builds an indexer only where its IndexCache
statements find ``skip_topk`` false, and always on an MTP layer
(:func:`vllm_builds_indexer` runs those statements). GLM-5.3's 78 decoder
layers register 78 latent and 21 indexer caches; the tiny configs here keep
the same pattern (8 layers: 8 latent + 3 indexer caches, on layers 0, 1 and
5), so LMCache's two kernel groups hold different layer counts.
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
# Decoder layers of the tiny model the GLM-5 KV tests run: with GLM-5.3's
# pattern 8 latent and 3 indexer caches (layers 0, 1, 5), so each of
# LMCache's kernel groups has its own layer count.
NUM_LAYERS = 8
GLM53_CONFIG = Path(__file__).resolve().parents[2] / "scripts" / "kvsizing" / "glm-5.3-fp8.config.json"
# The keys of GLM-5.3's config that decide which layers carry an indexer.
PATTERN_KEYS = ("index_topk_freq", "index_skip_topk_offset", "index_topk_pattern")
# The keys that size the caches' rows (the latent: kv_lora_rank +
# qk_rope_head_dim; the indexer key: index_head_dim).
ROW_KEYS = ("kv_lora_rank", "qk_rope_head_dim", "index_head_dim")


def glm53_config() -> dict[str, Any]:
    """GLM-5.3's config.json as the project keeps it (the KV geometry's keys)."""
    return json.loads(GLM53_CONFIG.read_text())


def kvsizing_geometry() -> Any:
    """scripts/kvsizing/geometry.py: kv-sizing's statement of vLLM's rule and rows."""
    import sys

    scripts = str(GLM53_CONFIG.parents[1])
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from kvsizing import geometry

    return geometry


def indexer_layers(num_hidden_layers: int = NUM_LAYERS, mtp_layers: int = 0) -> tuple[int, ...]:
    """The layers of the tiny model (GLM-5.3's pattern) that carry a DSA
    indexer cache, by kv-sizing's rule (test_glm5_chunk_figure.py checks it
    against vLLM's own decision)."""
    return kvsizing_geometry().indexer_layers(tiny_glm5_config(num_hidden_layers), mtp_layers)


def token_bytes(latent_bytes: int, num_hidden_layers: int = NUM_LAYERS, mtp_layers: int = 0) -> int:
    """Bytes of one token over every cache of the tiny model: one latent row
    per layer, one indexer row per indexer layer."""
    indexers = len(indexer_layers(num_hidden_layers, mtp_layers))
    return (num_hidden_layers + mtp_layers) * latent_bytes + indexers * INDEXER_BYTES


def tiny_glm5_config(num_hidden_layers: int) -> dict[str, Any]:
    """A tiny ``GlmMoeDsaForCausalLM`` config (small hidden sizes, few
    experts) with GLM-5.3's KV geometry and indexer pattern
    (``index_topk_freq``, ``index_skip_topk_offset``), taken from GLM-5.3's
    config; with ``num_hidden_layers`` 78 its KV caches are GLM-5.3's."""
    glm53 = glm53_config()
    kv_keys = {key: glm53[key] for key in (*ROW_KEYS, *PATTERN_KEYS) if key in glm53}
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
        **kv_keys,
    }


def _index_cache_statements():
    """vLLM's own statements that decide whether a layer builds a DSA indexer:
    the IndexCache block of ``DeepseekV2MLAAttention.__init__`` (from
    ``self.is_v32 = ...`` to the ``if`` that builds ``self.indexer``), and
    that ``if``'s condition, compiled from vLLM's source as it is."""
    import ast
    import inspect
    import textwrap

    from vllm.model_executor.models import deepseek_v2

    init = deepseek_v2.DeepseekV2MLAAttention.__init__
    (func,) = ast.parse(textwrap.dedent(inspect.getsource(init))).body
    body = func.body

    def assigns_self(node: ast.AST, attr: str) -> bool:
        return any(
            isinstance(target, ast.Attribute) and target.attr == attr
            and isinstance(target.value, ast.Name) and target.value.id == "self"
            for sub in ast.walk(node) if isinstance(sub, (ast.Assign, ast.AnnAssign))
            for target in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
        )

    starts = [i for i, node in enumerate(body) if isinstance(node, ast.Assign) and assigns_self(node, "is_v32")]
    builds = [i for i, node in enumerate(body) if isinstance(node, ast.If) and assigns_self(node, "indexer")]
    if len(starts) != 1 or len(builds) != 1 or not starts[0] < builds[0]:
        raise AssertionError("DeepseekV2MLAAttention.__init__ no longer has one IndexCache block "
                             "followed by one `if` that builds self.indexer: review glm5_vllm_kv")
    block = body[starts[0]:builds[0]]
    # Only the decision runs: names and self.is_v32 are assigned, nothing is built.
    assigned = {
        ast.unparse(target) for node in block for sub in ast.walk(node)
        if isinstance(sub, ast.Assign) for target in sub.targets
    }
    expected = {"self.is_v32", "_skip_topk", "is_mtp_layer", "_index_topk_freq", "_index_topk_pattern",
                "_index_skip_topk_offset", "layer_id", "_num_hidden_layers"}
    if not assigned <= expected:
        raise AssertionError(f"vLLM's IndexCache block assigns {sorted(assigned - expected)}: review glm5_vllm_kv")
    test = body[builds[0]].test
    decision = ast.copy_location(ast.Assign(targets=[ast.Name("builds_indexer", ast.Store())], value=test), test)
    module = ast.Module(body=[*block, decision], type_ignores=[])
    ast.increment_lineno(module, init.__code__.co_firstlineno - 1)
    code = compile(ast.fix_missing_locations(module), inspect.getsourcefile(init) or "<vllm>", "exec")
    return code, deepseek_v2


def vllm_builds_indexer(hf_config: Any, layer_indices: list[int]) -> list[bool]:
    """For each layer index (``model.layers.<i>``; MTP layers follow the
    decoder layers, as vLLM's ``DeepSeekMultiTokenPredictor`` numbers them),
    whether vLLM 0.31.0's ``DeepseekV2MLAAttention`` builds a DSA indexer for
    ``hf_config`` (vLLM's own statements decide, run on vLLM's config)."""
    code, module = _index_cache_statements()
    decisions = []
    for index in layer_indices:
        namespace = dict(vars(module), self=SimpleNamespace(), config=hf_config,
                         prefix=f"model.layers.{index}.self_attn")
        exec(code, namespace)  # noqa: S102 - vLLM's own statements
        decisions.append(bool(namespace["builds_indexer"]))
    return decisions


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
    indexer cache, where vLLM builds one, before its MLA attention). Layers
    ``num_hidden_layers`` and up are MTP layers."""
    import torch
    from vllm.model_executor.layers.attention.mla_attention import (
        MLAAttention,
        _canonicalize_sparse_mla_kv_cache_dtype,
    )
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

    cache_config = vllm_config.cache_config
    hf_config = vllm_config.model_config.hf_config
    builds_indexer = vllm_builds_indexer(hf_config, list(range(num_layers)))
    # As the layers' __init__ sets them: the latent's head size and the
    # indexer key's row (index_head_dim fp8 values and one fp32 scale per 128).
    latent_head_size = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
    indexer_row = hf_config.index_head_dim + hf_config.index_head_dim // 128 * 4
    specs: dict[str, Any] = {}
    # B300 is SM103 (capability family 100): MLAAttention then aligns the
    # latent cache's block stride to its row size.
    original_family = current_platform.is_device_capability_family
    current_platform.is_device_capability_family = lambda family, *a, **k: sm100 and family == 100
    try:
        for i in range(num_layers):
            prefix = f"model.layers.{i}.self_attn"
            indexer = None
            if builds_indexer[i]:
                indexer = SimpleNamespace(cache_config=cache_config, head_dim=indexer_row, dtype=torch.uint8)
                spec = DeepseekV32IndexerCache.get_kv_cache_spec(indexer, vllm_config)
                specs[f"{prefix}.indexer.k_cache"] = DeepseekV32IndexerBackend.customize_spec(spec)
            attn = SimpleNamespace(
                kv_cache_dtype=_canonicalize_sparse_mla_kv_cache_dtype(
                    backend, cache_config.cache_dtype
                ),
                head_size=latent_head_size,
                sliding_window=None,
                indexer=indexer,  # None on a layer that reuses an earlier layer's top-k
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
    num_hidden_layers: int = NUM_LAYERS,
    num_blocks: int = 24,
    sm100: bool = True,
    device: str = "cpu",
    mtp_layers: int = 0,
) -> Glm5KV:
    """The ``kv_caches`` dict vLLM registers for ``num_hidden_layers`` decoder
    layers and ``mtp_layers`` MTP layers (none by default: the presets
    configure no speculative decoding; with MTP speculative decoding the
    drafter's layers follow the decoder layers, each with an indexer), with
    about ``num_blocks`` blocks of 64 tokens, on ``device``."""
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
    specs = layer_specs(vllm_config, num_hidden_layers + mtp_layers, backend, sm100)
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
