"""The engine harness's environment (no engine needed): every engine its own NIXL side-channel port."""
from __future__ import annotations

import socket
from pathlib import Path

from tests.support.engine import NIXL_PORT_ENV, EngineSpec, engine_env

MODEL = Path("/models/tiny")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_every_engine_gets_a_free_nixl_side_channel_port(tmp_path, monkeypatch):
    # vLLM's default (5600) in the test's own environment must not leak through
    monkeypatch.setenv(NIXL_PORT_ENV, "5600")
    port = int(engine_env(EngineSpec(MODEL, {}), tmp_path)[NIXL_PORT_ENV])
    assert port != 5600 and 20000 <= port < 32000 and _free(port)
    # the listener binds the port plus the data-parallel index: a free block per engine
    dp = int(engine_env(EngineSpec(MODEL, {"data-parallel-size": 3}), tmp_path)[NIXL_PORT_ENV])
    assert all(_free(p) for p in range(dp, dp + 3))


def test_a_spec_that_names_its_nixl_port_keeps_it(tmp_path):
    spec = EngineSpec(MODEL, {}, env={NIXL_PORT_ENV: "23456"})
    assert engine_env(spec, tmp_path)[NIXL_PORT_ENV] == "23456"
