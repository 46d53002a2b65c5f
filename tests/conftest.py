"""Shared pytest fixtures and markers for the distribution's tests.

The suite runs against one LMCache build at a time, named by the environment
variable ``DIST_LMCACHE_TREE`` (``patched``, the default, or ``pristine``).
Tests marked ``@pytest.mark.fixes("<patch file>")`` prove a patch: on the
patched tree they must pass; on the pristine tree they are run as strict
xfail, so a proof test that passes on pristine fails the run.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.valkey import ValkeyServer, start_valkey

TREE_ENV = "DIST_LMCACHE_TREE"
PATCHES = Path(__file__).resolve().parents[1] / "patches"


def series_patches() -> set[str]:
    """Every patch file listed in a patches/*/series."""
    names: set[str] = set()
    for series in PATCHES.glob("*/series"):
        for line in series.read_text().splitlines():
            entry = line.split("#", 1)[0].strip()
            if entry:
                names.add(entry.split()[0])
    return names


def lmcache_tree() -> str:
    tree = os.environ.get(TREE_ENV, "patched")
    if tree not in ("patched", "pristine"):
        raise pytest.UsageError(f"{TREE_ENV}={tree!r}: expected 'patched' or 'pristine'")
    return tree


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fixes(patch): proves the named patch; strict xfail on the pristine tree",
    )
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped on CPU machines")
    config.addinivalue_line("markers", "runtime_image: needs the serving image make image builds; skipped without it")
    config.addinivalue_line("markers", "lmcache: needs an LMCache build in the running interpreter")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tree = lmcache_tree()
    known = series_patches()
    for item in items:
        if item.get_closest_marker("gpu") is not None and not _has_cuda():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        marker = item.get_closest_marker("fixes")
        if marker is not None and (not marker.args or marker.args[0] not in known):
            raise pytest.UsageError(
                f"{item.nodeid}: @pytest.mark.fixes({', '.join(map(repr, marker.args))}) "
                "does not name a patch listed in patches/*/series"
            )
        if marker is None or tree != "pristine":
            continue
        item.add_marker(
            pytest.mark.xfail(
                strict=True,
                reason=f"proof of {marker.args[0]}: must fail on the pristine tree",
            )
        )


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture
def valkey(tmp_path) -> ValkeyServer:
    """A real Valkey 8.1 server on a free loopback port, stopped afterwards."""
    server = start_valkey(tmp_path)
    try:
        yield server
    finally:
        server.stop()
