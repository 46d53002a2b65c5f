"""Role presets: ``prefill``, ``decode`` and ``aggregated`` from configs/ (in the image: /etc/glm53).

A preset is the role's ``env`` file (``KEY=VALUE`` lines, no quotes) plus
``vllm serve MODEL --config <role>/vllm.yaml``. Variables already set in the
container's environment win over the env file, so an operator can override
any of them with ``-e``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROLES = ("prefill", "decode", "aggregated")


class PresetError(ValueError):
    pass


def parse_env_file(text: str, where: str = "env") -> dict[str, str]:
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key.replace("_", "").isalnum() or key[0].isdigit():
            raise PresetError(f"{where}:{number}: expected KEY=VALUE, got {raw!r}")
        values[key] = value
    return values


@dataclass(frozen=True)
class Preset:
    role: str
    config_dir: Path

    @property
    def vllm_config(self) -> Path:
        return self.config_dir / "vllm.yaml"

    def env(self) -> dict[str, str]:
        path = self.config_dir / "env"
        return parse_env_file(path.read_text(), str(path)) if path.is_file() else {}

    def command(self, model: str, extra: list[str]) -> list[str]:
        return ["vllm", "serve", model, "--config", str(self.vllm_config), *extra]


def load(role: str, config_root: Path) -> Preset:
    if role not in ROLES:
        raise PresetError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    preset = Preset(role, config_root / role)
    if not preset.vllm_config.is_file():
        raise PresetError(f"{preset.vllm_config}: missing (the image ships configs/{role}/ there)")
    return preset


def merged_env(preset_env: dict[str, str], environ: dict[str, str]) -> dict[str, str]:
    """The preset's variables under the container's: an explicit -e always wins."""
    return {**environ, **{k: v for k, v in preset_env.items() if k not in environ}}
