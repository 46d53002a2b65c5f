"""The harness runs each phase against the LMCache build it claims to."""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

from tests.conftest import lmcache_tree

pytestmark = pytest.mark.lmcache


def test_the_imported_lmcache_is_the_selected_tree():
    import lmcache

    location = Path(lmcache.__file__).resolve()
    version = importlib.metadata.version("lmcache")
    if lmcache_tree() == "pristine":
        assert "lmcache-pristine" in location.parts, location
        assert version == "0.5.5"
    else:
        assert "lmcache-pristine" not in location.parts, location
        assert "site-packages" in location.parts, location
        assert version.startswith("0.5.5")


def test_the_native_resp_connector_is_compiled():
    """NO_GPU_EXT=1 still builds the common C++ extensions the RESP tier needs."""
    from lmcache.lmcache_redis import LMCacheRedisClient  # noqa: F401
    from lmcache.v1.storage_backend.native_clients import resp_client

    assert resp_client.REDIS_AVAILABLE


def test_pristine_phase_only_runs_on_a_pristine_install():
    if lmcache_tree() == "pristine":
        assert os.environ.get("PYTHONPATH", "").endswith("lmcache-pristine")
