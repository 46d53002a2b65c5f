"""Fixtures and markers of the launch-config, deployment and sizing tests.

Markers:
  vllm_wheel  needs the pinned vLLM 0.31.0 wheel in the running interpreter
              (tests/configs/requirements-vllm.txt says how to install it);
              skipped without it unless DIST_REQUIRE_VLLM_WHEEL=1, which
              turns the skip into a failure (for CI jobs that installed it).
  lmcache     needs LMCache (the patched build) in the running interpreter.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from tests.configs.support import load_validate


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm_wheel: needs the pinned vllm 0.31.0 wheel (tests/configs/requirements-vllm.txt)"
    )


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    require_vllm = os.environ.get("DIST_REQUIRE_VLLM_WHEEL") == "1"
    have_vllm = _have("vllm")
    have_lmcache = _have("lmcache")
    for item in items:
        if item.get_closest_marker("vllm_wheel") is not None and not have_vllm and not require_vllm:
            item.add_marker(pytest.mark.skip(
                reason="needs the vllm 0.31.0 wheel: see tests/configs/requirements-vllm.txt"))
        if item.get_closest_marker("lmcache") is not None and not have_lmcache:
            item.add_marker(pytest.mark.skip(reason="needs LMCache in this interpreter"))


@pytest.fixture(scope="session")
def validate():
    """configs/validate.py, imported by path."""
    return load_validate()
