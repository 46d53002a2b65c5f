"""The launch presets (configs/<role>/) turned into an engine start on this CPU.

Every key of a preset's ``vllm.yaml``, ``lmcache.yaml`` and ``env`` is either
kept as it is or changed by a rule below, each with the reason CPU cannot run
the preset's value. A key no rule knows fails (:class:`OverlayError`), so a
preset change reaches the engine tests: a kept key flows through, a new one
must be decided here. What the test adds on top (the tiny model's dtype and
length, loopback Valkeys) is listed apart, in ``TEST_ADDITIONS``.

vllm.yaml:

| key | preset | CPU | why |
| --- | --- | --- | --- |
| prefill-context-parallel-size | 8 | 1 | PCP runs only on the V2 model runner, which needs Triton; \
triton-cpu is not on the package index |
| tensor-parallel-size | 8 (aggregated) | 1 | 8 ranks on 2 cores do not start in the budget; \
TP over gloo runs in the TP=2 scenario |
| kv-cache-dtype | fp8 | auto | vLLM's CPU MLA backend supports only the model dtype \
(CPUMLABackend.supported_kv_cache_dtypes) |
| moe-backend | flashinfer_trtllm | dropped | FlashInfer's TRTLLM-gen MoE is a Blackwell kernel; \
the tiny model is dense (no MoE layer to back) |
| attention-backend | FLASHINFER_MLA_SPARSE | CPU_MLA | GLM-5's sparse MLA has no CPU backend; \
CPU_MLA is vLLM's dense MLA on CPU (still pinned: a missing backend fails, no fallback) |
| kv-transfer-config NixlConnector kv_buffer_device | cuda | cpu | no GPU memory; NIXL registers the CPU KV cache |
| kv-transfer-config NixlConnector backends | [LIBFABRIC] | [UCX] | no EFA here; \
UCX is bundled in nixl-cu13 and runs over loopback |
| profiler-config | cuda | dropped | the CUDA profiler hook needs CUDA |

lmcache.yaml: ``max_local_cpu_size`` 768 GiB -> 0.5 GiB (this machine has 24
GB for everyone); ``remote_url``'s host template becomes loopback Valkeys
with ``{rank}`` kept (in the port: instance r listens on ``base + r``, see
:func:`rank_url`); ``use_gpu_connector_v3`` true -> false (LMCache refuses
V3 on a CPU device, and the CPU connector, tests/support/cpu_connector, stands
in for every GPU connector). ``pcp_shard_store`` stays: at PCP 1 LMCache logs that it
has no effect and stores as ``save_only_first_rank``.

env: ``VLLM_USE_V2_MODEL_RUNNER`` dropped (needs Triton, as PCP);
``LMCACHE_CONFIG_FILE`` points at the generated LMCache file.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from tests.support.engine import EngineSpec

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
DROP = object()


class OverlayError(ValueError):
    """A preset key the CPU overlay has no rule for, or a value it cannot map."""

    def __init__(self, path: Path, key: str, message: str):
        super().__init__(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: key '{key}': {message}")


def _fp8_to_auto(value: Any) -> Any:
    return "auto" if str(value).startswith("fp8") else value


def _nixl_on_cpu(child: dict) -> dict:
    child = copy.deepcopy(child)
    if child.get("kv_buffer_device") is not None:
        child["kv_buffer_device"] = "cpu"
    extra = child.setdefault("kv_connector_extra_config", {})
    if "backends" in extra:
        extra["backends"] = ["UCX"]
    return child


CHILD_RULES: dict[str, Callable[[dict], dict]] = {
    "NixlConnector": _nixl_on_cpu,
    "LMCacheConnectorV1": copy.deepcopy,
}


def _kv_transfer_on_cpu(value: dict) -> dict:
    value = copy.deepcopy(value)
    name = value.get("kv_connector")
    children = (value.get("kv_connector_extra_config") or {}).get("connectors")
    if name == "MultiConnector" and children is not None:
        for i, child in enumerate(children):
            rule = CHILD_RULES.get(child.get("kv_connector"))
            if rule is None:
                raise ValueError(f"connector {child.get('kv_connector')!r}: no CPU rule (tests/support/cpu_overlay.py)")
            children[i] = rule(child)
        return value
    rule = CHILD_RULES.get(name)
    if rule is None:
        raise ValueError(f"connector {name!r}: no CPU rule (tests/support/cpu_overlay.py)")
    return rule(value)


# vllm.yaml: key -> None (kept) or a function of the preset's value (DROP removes the key).
VLLM_RULES: dict[str, Callable[[Any], Any] | None] = {
    "served-model-name": None,
    "prefill-context-parallel-size": lambda v: 1,
    "tensor-parallel-size": lambda v: 1,
    "enable-expert-parallel": None,
    "kv-cache-dtype": _fp8_to_auto,
    "max-num-batched-tokens": None,
    "moe-backend": lambda v: DROP,
    "attention-backend": lambda v: "CPU_MLA",
    "kv-transfer-config": _kv_transfer_on_cpu,
    "profiler-config": lambda v: DROP,
    "enable-prompt-tokens-details": None,
}

# What the test adds: the tiny checkpoint's dtype and length; eager mode
# (torch.compile of every start would dominate the engine phase on 2 cores).
TEST_ADDITIONS = {"dtype": "float32", "max-model-len": 2048, "enforce-eager": True}

LMCACHE_KEPT = {"chunk_size", "local_cpu", "enable_async_loading", "lookup_timeout_ms", "blocking_timeout_secs",
                "save_unfull_chunk", "remote_serde"}
EXTRA_CONFIG_KEPT = {"pcp_shard_store", "resp_num_threads", "save_only_first_rank", "remote_enable_mla_worker_id_as0"}
L1_GIB = 0.5
# The offline defaults hold on CPU too: the engines here load local folders and send nothing.
ENV_KEPT = {"PYTHONHASHSEED", "VLLM_ENGINE_READY_TIMEOUT_S", "HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"}
ENV_DROPPED = {"VLLM_USE_V2_MODEL_RUNNER"}


def rank_url(url: str, base_port: int) -> str:
    """The preset's remote_url with its host template replaced by loopback
    instances, ``{rank}`` kept: rank r's Valkey listens on ``base_port + r``
    (``base_port`` a multiple of 10, so the template is ``<base // 10>{rank}``)."""
    if base_port % 10:
        raise ValueError(f"base port {base_port}: must be a multiple of 10")
    match = re.fullmatch(r"(resp|redis)://[^/:]*\{rank\}[^/:]*:\d+", url)
    if match is None:
        raise ValueError(f"{url!r}: expected resp://<host with {{rank}}>:<port> (one instance per rank)")
    return f"{match.group(1)}://127.0.0.1:{base_port // 10}{{rank}}"


@dataclass
class Preset:
    role: str
    vllm: dict
    lmcache: dict | None
    env: dict[str, str]


def load_preset(role: str, configs: Path = CONFIGS) -> Preset:
    from tests.configs.support import load_validate

    validate = load_validate()
    folder = configs / role
    vllm = yaml.safe_load((folder / "vllm.yaml").read_text())
    lmcache_file = folder / "lmcache.yaml"
    lmcache = yaml.safe_load(lmcache_file.read_text()) if lmcache_file.is_file() else None
    env = validate.read_env_file(folder / "env") if (folder / "env").is_file() else {}
    return Preset(role, vllm, lmcache, env)


def overlay_vllm(preset: Preset, path: Path) -> dict:
    out: dict[str, Any] = {}
    for key, value in preset.vllm.items():
        if key not in VLLM_RULES:
            raise OverlayError(path, key, "not known to the CPU overlay: keep it or map it in "
                               "tests/support/cpu_overlay.py (VLLM_RULES), saying why")
        rule = VLLM_RULES[key]
        try:
            new = value if rule is None else rule(value)
        except ValueError as error:
            raise OverlayError(path, key, str(error)) from None
        if new is not DROP:
            out[key] = new
    return {**out, **TEST_ADDITIONS}


def overlay_lmcache(preset: Preset, path: Path, base_port: int) -> dict:
    assert preset.lmcache is not None
    out: dict[str, Any] = {}
    for key, value in preset.lmcache.items():
        if key in LMCACHE_KEPT:
            out[key] = value
        elif key == "max_local_cpu_size":
            out[key] = L1_GIB
        elif key == "use_gpu_connector_v3":
            # LMCache refuses V3 on a CPU device; the CPU connector stands in for it.
            out[key] = False
        elif key == "remote_url":
            try:
                out[key] = rank_url(value, base_port)
            except ValueError as error:
                raise OverlayError(path, key, str(error)) from None
        elif key == "extra_config":
            unknown = sorted(set(value) - EXTRA_CONFIG_KEPT)
            if unknown:
                raise OverlayError(path, f"extra_config.{unknown[0]}", "not known to the CPU overlay "
                                   "(tests/support/cpu_overlay.py, EXTRA_CONFIG_KEPT)")
            out[key] = dict(value)
        else:
            raise OverlayError(path, key, "not known to the CPU overlay: keep it or map it in "
                               "tests/support/cpu_overlay.py, saying why")
    return out


def overlay_env(preset: Preset, path: Path) -> dict[str, str]:
    out = {}
    for key, value in preset.env.items():
        if key in ENV_KEPT:
            out[key] = value
        elif key in ENV_DROPPED or key == "LMCACHE_CONFIG_FILE":
            continue  # LMCACHE_CONFIG_FILE: start_engine points it at the generated file
        else:
            raise OverlayError(path, key, "not known to the CPU overlay (tests/support/cpu_overlay.py, ENV_KEPT)")
    return out


def lmcache_api(port: int) -> dict:
    """Test addition: LMCache's internal API server on loopback (scheduler on
    ``port``, worker r on ``port + 1 + r``), whose DELETE /cache/clear empties
    L1 so one engine can serve a second cold run."""
    return {"internal_api_server_enabled": True, "internal_api_server_host": "127.0.0.1",
            "internal_api_server_port_start": port}


def cpu_spec(role: str, model: Path, base_port: int = 0, label: str | None = None,
             api_port: int | None = None, configs: Path = CONFIGS) -> EngineSpec:
    """The engine start of ``configs/<role>`` on this CPU (``base_port``: the Valkeys', see
    rank_url; ``api_port``: LMCache's internal API, see lmcache_api)."""
    preset = load_preset(role, configs)
    folder = configs / role
    lmcache = overlay_lmcache(preset, folder / "lmcache.yaml", base_port) if preset.lmcache is not None else None
    if lmcache is not None and api_port is not None:
        lmcache.update(lmcache_api(api_port))
    return EngineSpec(model, overlay_vllm(preset, folder / "vllm.yaml"), lmcache,
                      overlay_env(preset, folder / "env"), label or role)
