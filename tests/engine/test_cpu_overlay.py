"""The CPU overlay of the presets (no engine needed): strict, and faithful to the presets."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.support import cpu_overlay
from tests.support.cpu_overlay import CONFIGS, OverlayError, cpu_spec, load_preset, rank_url

MODEL = Path("/models/tiny")


@pytest.mark.parametrize("role", ["prefill", "aggregated"])
def test_overlay_keeps_every_key_it_has_no_cpu_reason_to_change(role):
    preset = load_preset(role)
    spec = cpu_spec(role, MODEL, base_port=45670)
    for key, value in preset.vllm.items():
        if cpu_overlay.VLLM_RULES[key] is None:
            assert spec.vllm_config[key] == value, key
    assert spec.vllm_config["kv-cache-dtype"] == "auto"
    assert spec.vllm_config["attention-backend"] == "CPU_MLA"
    assert "moe-backend" not in spec.vllm_config and "profiler-config" not in spec.vllm_config
    assert spec.vllm_config.get("prefill-context-parallel-size", 1) == 1
    assert spec.vllm_config.get("tensor-parallel-size", 1) == 1


def test_prefill_overlay_connectors_and_lmcache():
    preset = load_preset("prefill")
    spec = cpu_spec("prefill", MODEL, base_port=45670)
    children = spec.vllm_config["kv-transfer-config"]["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == ["NixlConnector", "LMCacheConnectorV1"]
    assert children[0]["kv_buffer_device"] == "cpu"
    assert children[0]["kv_connector_extra_config"]["backends"] == ["UCX"]
    assert spec.lmcache_config["remote_url"] == "resp://127.0.0.1:4567{rank}"
    for key in cpu_overlay.LMCACHE_KEPT & set(preset.lmcache):
        assert spec.lmcache_config[key] == preset.lmcache[key], key
    assert spec.lmcache_config["extra_config"] == preset.lmcache["extra_config"]
    # GLM-5 needs the V3 connector on the GPU node; on CPU LMCache refuses it.
    assert preset.lmcache["use_gpu_connector_v3"] is True and spec.lmcache_config["use_gpu_connector_v3"] is False
    assert "VLLM_USE_V2_MODEL_RUNNER" not in spec.env and "LMCACHE_CONFIG_FILE" not in spec.env


def _copy_configs(tmp_path: Path) -> Path:
    configs = tmp_path / "configs"
    shutil.copytree(CONFIGS / "prefill", configs / "prefill")
    return configs


@pytest.mark.parametrize("name, key", [("vllm.yaml", "speculative-config"), ("lmcache.yaml", "local_disk")])
def test_a_new_preset_key_fails_naming_file_and_key(tmp_path, name, key):
    configs = _copy_configs(tmp_path)
    path = configs / "prefill" / name
    data = yaml.safe_load(path.read_text())
    data[key] = "x"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(OverlayError, match=rf"prefill/{name}: key '{key}': not known to the CPU overlay"):
        cpu_spec("prefill", MODEL, base_port=45670, configs=configs)


def test_a_remote_url_without_rank_fails(tmp_path):
    configs = _copy_configs(tmp_path)
    path = configs / "prefill" / "lmcache.yaml"
    data = yaml.safe_load(path.read_text())
    data["remote_url"] = "resp://valkey-lmcache.vllm.svc.cluster.local:6379"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(OverlayError, match=r"key 'remote_url': .*one instance per rank"):
        cpu_spec("prefill", MODEL, base_port=45670, configs=configs)


def test_rank_url_keeps_rank_in_the_port():
    assert rank_url("resp://valkey-lmcache-{rank}.vllm.svc.cluster.local:6379", 45670) == \
        "resp://127.0.0.1:4567{rank}"
    with pytest.raises(ValueError, match="multiple of 10"):
        rank_url("resp://v-{rank}:6379", 45671)
