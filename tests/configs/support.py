"""Paths and by-path imports of the modules under test (configs/ is not a package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
DEPLOY = CONFIGS / "deploy"
SCRIPTS = REPO / "scripts"
ROLES = ("prefill", "decode", "aggregated")
MODEL = "/models/GLM-5.3-FP8"


def _load(name: str, path: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_validate() -> ModuleType:
    return _load("glm53_configs_validate", CONFIGS / "validate.py")


def load_render() -> ModuleType:
    return _load("glm53_deploy_render", DEPLOY / "render.py")


def load_kvsizing():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import kvsizing.cli
    import kvsizing.geometry
    import kvsizing.model

    return kvsizing
