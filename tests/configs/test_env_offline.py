"""The presets' offline defaults and what configs/validate.py accepts around them (no vLLM needed:
the VLLM_* parser checks run in test_vllm_configs.py with the wheel)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.configs.support import CONFIGS, ROLES

OFFLINE = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@pytest.mark.parametrize("role", ROLES)
def test_every_preset_runs_offline_and_leaves_the_cubin_flag_to_the_image(validate, role: str) -> None:
    env = validate.check_env_file(CONFIGS / role / "env", vllm=False, lmcache=False)
    assert {k: env.get(k) for k in OFFLINE} == OFFLINE
    assert "VLLM_HAS_FLASHINFER_CUBIN" not in env


@pytest.mark.parametrize("line, key, detail", [
    ("HF_HUB_OFFLINE=yes", "HF_HUB_OFFLINE", "'yes' is neither 0 nor 1"),
    ("VLLM_NO_USAGE_STATS=true", "VLLM_NO_USAGE_STATS", "only 1 turns it on"),
    ("DO_NOT_TRACK=", "DO_NOT_TRACK", "'' is neither 0 nor 1"),
    ("VLLM_HAS_FLASHINFER_CUBIN=1", "VLLM_HAS_FLASHINFER_CUBIN", "set by the image, not by a preset"),
])
def test_a_bad_offline_value_or_an_image_variable_is_named(validate, tmp_path: Path, line: str, key: str,
                                                           detail: str) -> None:
    env = tmp_path / "env"
    kept = [x for x in (CONFIGS / "decode" / "env").read_text().splitlines() if not x.startswith(key + "=")]
    env.write_text("\n".join([line, *kept]) + "\n")   # first: refused before any VLLM_* needs vLLM
    with pytest.raises(validate.ConfigError) as err:
        validate.check_env_file(env, vllm=False, lmcache=False)
    assert str(err.value).startswith(f"{env}: key '{key}': ") and detail in str(err.value)
    assert validate.main([str(env)]) == 1   # the CLI: non-zero, nothing written
