"""The entrypoint: upstream vllm-openai arguments, role presets from configs/, tools."""
from __future__ import annotations

from pathlib import Path

import pytest

from imagectl import entrypoint, presets

from .conftest import REPO

CONFIGS = REPO / "configs"
HOME = Path("/opt/glm53")


def plan(args: list[str], env: dict[str, str] | None = None) -> entrypoint.Plan:
    return entrypoint.plan(args, env or {}, home=HOME, config_root=CONFIGS)


def test_upstream_style_model_and_flags_go_to_vllm_serve() -> None:
    assert plan(["/models/GLM", "--tensor-parallel-size", "8"]).argv == \
        ["vllm", "serve", "/models/GLM", "--tensor-parallel-size", "8"]   # a model path, as upstream
    assert plan(["/bin/sh", "-c", "true"]).argv == ["/bin/sh", "-c", "true"]   # an executable runs as itself
    assert plan(["zai-org/GLM-5.3-FP8", "--tensor-parallel-size", "8"]).argv == \
        ["vllm", "serve", "zai-org/GLM-5.3-FP8", "--tensor-parallel-size", "8"]
    assert plan(["--model", "m", "--port", "8001"]).argv == ["vllm", "serve", "--model", "m", "--port", "8001"]


def test_vllm_and_serve_commands_pass_through() -> None:
    assert plan(["vllm", "serve", "m", "--port", "1"]).argv == ["vllm", "serve", "m", "--port", "1"]
    assert plan(["serve", "m"]).argv == ["vllm", "serve", "m"]
    assert plan(["bash", "-lc", "true"]).argv == ["bash", "-lc", "true"]


@pytest.mark.parametrize("role", presets.ROLES)
def test_role_preset_uses_the_shipped_config_and_env(role: str) -> None:
    chosen = plan([role, "/models/GLM-5.3-FP8", "--port", "8100"])
    assert chosen.argv == ["vllm", "serve", "/models/GLM-5.3-FP8", "--config", str(CONFIGS / role / "vllm.yaml"),
                           "--port", "8100"]
    assert chosen.env == presets.parse_env_file((CONFIGS / role / "env").read_text())
    assert chosen.env["VLLM_ENGINE_READY_TIMEOUT_S"] == "1800"


def test_prefill_preset_env_points_lmcache_at_the_shipped_file() -> None:
    env = plan(["prefill", "m"]).env
    # the Dockerfile copies configs/prefill there
    assert env["LMCACHE_CONFIG_FILE"] == "/etc/glm53/prefill/lmcache.yaml"
    assert "COPY configs/ /etc/glm53/" in (REPO / "Dockerfile").read_text()
    assert env["PYTHONHASHSEED"] == "0"


def test_container_environment_wins_over_the_preset() -> None:
    chosen = plan(["prefill", "m"], {"PYTHONHASHSEED": "7"})
    assert "PYTHONHASHSEED" not in chosen.env
    merged = presets.merged_env(presets.parse_env_file("A=1\nB=2\n"), {"B": "x"})
    assert merged == {"A": "1", "B": "x"}


def test_preset_model_from_env_or_a_clear_error() -> None:
    assert plan(["decode", "--port", "9"], {"MODEL": "/m"}).argv[:3] == ["vllm", "serve", "/m"]
    missing = plan(["decode"])
    assert missing.exit_code == 2 and "give the model path" in (missing.text or "")


def test_unknown_role_and_bad_env_lines(tmp_path: Path) -> None:
    with pytest.raises(presets.PresetError, match="unknown role"):
        presets.load("router", CONFIGS)
    with pytest.raises(presets.PresetError, match="env:2: expected KEY=VALUE"):
        presets.parse_env_file("A=1\nnot a line\n")
    with pytest.raises(presets.PresetError, match="missing"):
        presets.load("prefill", tmp_path)


def test_tools_self_test_and_documents() -> None:
    assert plan(["self-test", "--json"]).argv[1:] == ["-m", "imagectl.selftest", "--json"]
    assert plan(["replay", "run", "x"]).argv == [str(HOME / "scripts" / "replay"), "run", "x"]
    assert plan(["pd-proxy", "--port", "8000"]).argv[1:] == [str(HOME / "pd-proxy" / "toy_proxy_server.py"),
                                                             "--port", "8000"]
    assert plan(["pd-router", "--port", "8000"]).argv[1:] == ["-m", "vllm_router.launch_router", "--port", "8000"]
    assert plan(["sbom"]).argv == ["cat", str(HOME / "sbom.cdx.json")]
    assert plan([]).text and "prefill|decode|aggregated" in (plan([]).text or "")
    for tool in entrypoint.TOOLS:
        assert (REPO / "scripts" / tool).is_file()


def test_entrypoint_script_runs_and_prints_usage() -> None:
    import subprocess
    import sys
    out = subprocess.run([sys.executable, str(REPO / "image" / "entrypoint"), "--help"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "role preset" in out.stdout
