"""The vLLM launch configs, parsed by vLLM 0.31.0's own code (the pinned wheel, CPU only).

How far this goes: `vllm serve <model> --config FILE` through vLLM's
FlexibleArgumentParser and serve checks, AsyncEngineArgs.from_cli_args, and
the config objects that need neither the model's files nor a GPU
(ParallelConfig; KVTransferConfig for the parent and, built as
MultiConnector builds them, every child; the connector classes resolved by
vLLM's KVConnectorFactory). EngineArgs.create_engine_config is out of reach:
it reads the model's HF config from the weights directory and needs the CUDA
platform, which vLLM cannot load without libcuda.so.1.
"""
from __future__ import annotations

import shutil

import pytest

from tests.configs.support import CONFIGS, MODEL, ROLES

pytestmark = pytest.mark.vllm_wheel


@pytest.fixture(scope="module")
def checks(validate):
    return {role: validate.check_vllm_file(CONFIGS / role / "vllm.yaml", MODEL) for role in ROLES}


def test_vllm_is_the_pinned_release():
    import importlib.metadata

    assert importlib.metadata.version("vllm") == "0.31.0"


@pytest.mark.parametrize("role", ROLES)
def test_each_config_parses_with_vllm(checks, role):
    check = checks[role]
    assert check.engine_args.model == MODEL
    assert check.engine_args.served_model_name == ["glm-5.3-fp8"]
    assert check.engine_args.kv_cache_dtype == "fp8"


@pytest.mark.parametrize("role", ROLES)
def test_each_role_pins_the_flashinfer_kernels(checks, role):
    """A named MoE and attention backend: vLLM raises at start when it cannot run them
    (oracle/fp8.py _return_or_raise, platforms/cuda.py get_attn_backend_cls) instead of
    falling back to DeepGEMM/Triton as it does under "auto"."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend, map_fp8_backend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    check = checks[role]
    assert check.moe_backend == "flashinfer_trtllm"
    assert map_fp8_backend(check.moe_backend) is Fp8MoeBackend.FLASHINFER_TRTLLM
    assert check.attention_backend is AttentionBackendEnum.FLASHINFER_MLA_SPARSE


def test_the_pinned_attention_backend_serves_every_roles_parallelism(checks):
    """FLASHINFER_MLA_SPARSE refuses PCP and DCP together (supports_combination) and an
    fp8_ds_mla cache; no role combines them, and all run the FP8 cache it accepts."""
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseTRTLLMBackend

    for check in checks.values():
        ea = check.engine_args
        assert not (ea.prefill_context_parallel_size > 1 and ea.decode_context_parallel_size > 1)
        assert ea.kv_cache_dtype in FlashInferMLASparseTRTLLMBackend.supported_kv_cache_dtypes


def test_prefill_parallelism(checks):
    ea = checks["prefill"].engine_args
    assert ea.prefill_context_parallel_size == 8
    assert ea.tensor_parallel_size == 1
    assert ea.enable_expert_parallel is True
    assert ea.max_num_batched_tokens == 131072
    parallel = checks["prefill"].parallel_config
    assert parallel.world_size == 8  # the ranks "{rank}" runs over
    assert parallel.use_all2all  # EP x PCP: the AllGather/ReduceScatter MoE exchange
    assert parallel.all2all_backend == "allgather_reducescatter"


def test_prefill_connectors(checks):
    check = checks["prefill"]
    ktc = check.kv_transfer_config
    assert ktc.kv_connector == "MultiConnector"
    assert ktc.kv_role == "kv_both"
    assert ktc.kv_load_failure_policy == "recompute"
    assert check.connector_class.__name__ == "MultiConnector"
    (nixl, nixl_cls), (lmc, lmc_cls) = check.children
    assert (nixl.kv_connector, lmc.kv_connector) == ("NixlConnector", "LMCacheConnectorV1")
    # vLLM 0.31.0's NixlConnector refuses kv_consumer/kv_both under PCP > 1.
    assert nixl.kv_role == "kv_producer" and nixl.kv_buffer_device == "cuda"
    assert lmc.kv_role == "kv_both"
    assert nixl_cls.__name__.startswith("Nixl") and lmc_cls.__name__ == "LMCacheConnectorV1"
    # Children carry the parent's engine id (MultiConnector passes it).
    assert nixl.engine_id == lmc.engine_id == ktc.engine_id


def test_prefill_profiler_hook(checks):
    assert checks["prefill"].engine_args.profiler_config.profiler == "cuda"


def test_decode_is_the_nixl_consumer(checks):
    check = checks["decode"]
    ea = check.engine_args
    assert ea.data_parallel_size == 8 and ea.tensor_parallel_size == 1
    assert ea.enable_expert_parallel is True
    assert check.kv_transfer_config.kv_connector == "NixlConnector"
    assert check.kv_transfer_config.kv_role == "kv_consumer"
    assert check.connector_class.__name__.startswith("Nixl")
    assert check.parallel_config.world_size == 1  # TP1 per DP engine


def test_aggregated_baseline(checks):
    ea = checks["aggregated"].engine_args
    assert ea.tensor_parallel_size == 8
    assert ea.prefill_context_parallel_size == 1 and ea.data_parallel_size == 1
    assert ea.kv_transfer_config is None
    assert checks["aggregated"].parallel_config.world_size == 8


def test_prefill_and_decode_agree_on_what_nixl_hashes(checks):
    """NIXL refuses to pair engines whose compatibility hash differs
    (nixl/metadata.py): same model path, KV dtype and HMA state."""
    p, d = checks["prefill"], checks["decode"]
    assert p.engine_args.model == d.engine_args.model
    assert p.engine_args.kv_cache_dtype == d.engine_args.kv_cache_dtype
    # vLLM turns HMA off where the connector config does not support it
    # (config/vllm.py); LMCacheConnectorV1 does not, so prefill runs without.
    prefill_hma = p.engine_args.disable_hybrid_kv_cache_manager is not True and p.hma_supported
    decode_hma = d.engine_args.disable_hybrid_kv_cache_manager is not True and d.hma_supported
    assert p.hma_supported is False
    assert d.hma_supported is True  # so decode must turn it off explicitly...
    assert prefill_hma == decode_hma == False  # noqa: E712  ...and does


def test_decode_engines_match_prefill_transfer_size(checks):
    """PCP producers without DCP hand off from TP rank 0 at TP 1; each decode DP engine is TP 1."""
    p, d = checks["prefill"].engine_args, checks["decode"].engine_args
    assert p.decode_context_parallel_size == 1 and d.decode_context_parallel_size == 1
    assert p.tensor_parallel_size == d.tensor_parallel_size == 1


@pytest.mark.parametrize("role", ROLES)
def test_env_files(validate, role):
    import vllm.envs as envs

    env = validate.check_env_file(CONFIGS / role / "env")
    assert env["VLLM_ENGINE_READY_TIMEOUT_S"] == "1800"
    if role == "prefill":
        with validate._patched_environ({"VLLM_USE_V2_MODEL_RUNNER": env["VLLM_USE_V2_MODEL_RUNNER"]}):
            assert envs.environment_variables["VLLM_USE_V2_MODEL_RUNNER"]() is True


# --- deliberately broken configs: file and key named -----------------------------------------

BROKEN = {
    "unknown-key": (("", "\ntensor-paralel-size: 2\n"), "tensor-paralel-size", "did you mean 'tensor-parallel-size'"),
    "abbreviated-key": (("", "\nprefill-context-parallel: 4\n"), "prefill-context-parallel", "not an option"),
    "wrong-type": (("prefill-context-parallel-size: 8", "prefill-context-parallel-size: eight"),
                   "prefill-context-parallel-size", "invalid int value"),
    "bad-choice": (("kv-cache-dtype: fp8", "kv-cache-dtype: fp9"), "kv-cache-dtype", "invalid choice"),
    "nested-unknown": (("kv_load_failure_policy: recompute", "kv_load_failure_polcy: recompute"),
                       "kv-transfer-config.kv_load_failure_polcy", ""),
    "nested-value": (("kv_load_failure_policy: recompute", "kv_load_failure_policy: retry"),
                     "kv-transfer-config.kv_load_failure_policy", "'recompute' or 'fail'"),
    "child-unknown": (("kv_role: kv_producer", "kv_rol: kv_producer"),
                      "kv-transfer-config.kv_connector_extra_config.connectors[0].kv_rol", ""),
    "child-connector": (("kv_connector: NixlConnector", "kv_connector: NixlConector"),
                        "kv-transfer-config.kv_connector_extra_config.connectors[0].kv_connector",
                        "Unsupported connector type"),
    "profiler": (("profiler: cuda", "profiler: nsys"), "profiler-config.profiler", "'torch', 'cuda' or 'proton'"),
    "moe-unpinned": (("\nmoe-backend: flashinfer_trtllm\n", "\n"), "moe-backend", "not set"),
    "moe-auto": (("moe-backend: flashinfer_trtllm", "moe-backend: auto"), "moe-backend", "fall back silently"),
    "moe-not-fp8": (("moe-backend: flashinfer_trtllm", "moe-backend: flashinfer_cutedsl"), "moe-backend",
                    "not supported for FP8 MoE"),
    "attention-unpinned": (("\nattention-backend: FLASHINFER_MLA_SPARSE\n", "\n"), "attention-backend", "not set"),
    "attention-typo": (("attention-backend: FLASHINFER_MLA_SPARSE", "attention-backend: FLASHINFER_MLA_SPARS"),
                       "attention-backend", ""),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_vllm_config_names_file_and_key(validate, tmp_path, case):
    (old, new), key, detail = BROKEN[case]
    text = (CONFIGS / "prefill" / "vllm.yaml").read_text()
    assert old in text
    broken = tmp_path / "vllm.yaml"
    broken.write_text(text.replace(old, new, 1) if old else text + new)
    with pytest.raises(validate.ConfigError) as err:
        validate.check_vllm_file(broken, MODEL)
    assert err.value.path == str(broken)
    assert err.value.key == key
    assert str(err.value).startswith(f"{broken}: key '{key}': ")
    assert detail in str(err.value)


def test_vllms_parser_alone_accepts_an_abbreviated_key(validate, tmp_path):
    """Why the wrapper checks keys exactly: argparse's prefix matching lets a
    truncated key through vLLM's own parser as a different option."""
    config = tmp_path / "vllm.yaml"
    config.write_text((CONFIGS / "prefill" / "vllm.yaml").read_text() + "\nprefill-context-parallel: 4\n")
    parser, _ = validate.serve_parser()
    args = parser.parse_args(["serve", MODEL, "--config", str(config)])
    assert args.prefill_context_parallel_size == 4  # silently overrode the real key


def test_validate_cli(validate, tmp_path, capsys):
    assert validate.main([str(CONFIGS / "decode" / "vllm.yaml"), str(CONFIGS / "decode" / "env")]) == 0
    assert "ok:" in capsys.readouterr().out
    shutil.copy(CONFIGS / "decode" / "vllm.yaml", tmp_path / "vllm.yaml")
    with open(tmp_path / "vllm.yaml", "a") as f:
        f.write("\ndata-paralel-size: 4\n")
    assert validate.main([str(tmp_path / "vllm.yaml")]) == 1
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'vllm.yaml'}: key 'data-paralel-size'" in err


@pytest.mark.parametrize("line, key, detail", [
    ("VLLM_USE_V2_MODEL_RUNNER=yes", "VLLM_USE_V2_MODEL_RUNNER", "cannot parse 'yes'"),
    ("VLLM_USE_V2_MODEL_RUNER=1", "VLLM_USE_V2_MODEL_RUNER", "did you mean 'VLLM_USE_V2_MODEL_RUNNER'"),
    ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF", "refuses"),
])
def test_broken_env_names_file_and_key(validate, tmp_path, line, key, detail):
    env = tmp_path / "env"
    base = [x for x in (CONFIGS / "prefill" / "env").read_text().splitlines() if not x.startswith(key + "=")]
    env.write_text("\n".join(base + [line]) + "\n")
    with pytest.raises(validate.ConfigError) as err:
        validate.check_env_file(env)
    assert str(err.value).startswith(f"{env}: key '{key}': ")
    assert detail in str(err.value)
