"""Fixtures of the operator tools' tests: the tools' package and the build tool's on sys.path, a fake engine."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
BUILD = Path(__file__).resolve().parents[2] / "build"  # distbuild.paths: where downloads are kept
for folder in (SCRIPTS, BUILD):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from tests.ops.fake_engine import FakeEngine  # noqa: E402


@pytest.fixture
def engine():
    """A fake vLLM HTTP API on a free loopback port (see fake_engine.py)."""
    server = FakeEngine().start()
    try:
        yield server
    finally:
        server.stop()
