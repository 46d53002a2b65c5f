"""The presets, run: configs/aggregated on the CPU overlay, and LMCache's degraded mode caught.

configs/prefill runs in test_protocol.py (and at TP 2 in test_tp2.py).
"""
from __future__ import annotations

import pytest

from tests.engine.prompts import PROMPT, same_output
from tests.support import cpu_overlay
from tests.support.engine import EngineError, free_port_block, observe
from tests.support.valkey import start_valkey


@pytest.mark.engine
def test_aggregated_preset_serves(engines, tiny_model):
    """No connector: vLLM's CPU MLA turns its own prefix cache off, so both runs are cold."""
    spec = cpu_overlay.cpu_spec("aggregated", tiny_model)
    assert spec.lmcache_config is None and "kv-transfer-config" not in spec.vllm_config
    server = engines.start(spec)
    first, second = observe(server, [], PROMPT), observe(server, [], PROMPT)
    same_output(first, second)
    assert not first.counts.lines and not second.counts.lines
    log = server.log_text()
    assert "Using CPU_MLA backend" in log and "LMCacheConnectorV1" not in log


@pytest.mark.engine
def test_degraded_lmcache_fails_the_harness(engines, tiny_model, tmp_path):
    """Without the CPU connector LMCache switches itself off while the server starts and
    answers: the harness must refuse such an engine, naming the cause."""
    base = free_port_block(1)
    valkey = start_valkey(tmp_path, port=base)
    try:
        spec = cpu_overlay.cpu_spec("prefill", tiny_model, base, label="prefill-no-cpu-connector")
        spec.cpu_connector = False
        with pytest.raises(EngineError, match=r"degraded mode") as raised:
            engines.start(spec)
        assert "No supported cpu connector found" in str(raised.value)
        assert valkey.client().dbsize() == 0
    finally:
        valkey.stop()
