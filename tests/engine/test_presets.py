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
def test_lmcache_init_failure_stops_the_sharded_prefill_engine(engines, tiny_model, tmp_path):
    """Without the CPU connector LMCache's init fails ("No supported cpu connector
    found"). With the prefill preset's pcp_shard_store that is fatal (patch 0012): the
    engine exits while starting, naming the cause, instead of one rank degrading alone."""
    base = free_port_block(1)
    valkey = start_valkey(tmp_path, port=base)
    try:
        spec = cpu_overlay.cpu_spec("prefill", tiny_model, base, label="prefill-no-cpu-connector")
        assert spec.lmcache_config["extra_config"]["pcp_shard_store"] is True
        spec.cpu_connector = False
        with pytest.raises(EngineError, match=r"exited with \d+ while starting") as raised:
            engines.start(spec)
        log = raised.value.log_text
        assert "No supported cpu connector found" in log
        assert "degraded mode" not in log
        assert valkey.client().dbsize() == 0
    finally:
        valkey.stop()


@pytest.mark.engine
def test_degraded_lmcache_fails_the_harness(engines, tiny_model, tmp_path):
    """Outside shard mode LMCache switches itself off while the server starts and
    answers (upstream's degraded mode): the harness must refuse such an engine, naming
    the cause. The prefill preset with pcp_shard_store off, without the CPU connector."""
    base = free_port_block(1)
    valkey = start_valkey(tmp_path, port=base)
    try:
        spec = cpu_overlay.cpu_spec("prefill", tiny_model, base, label="prefill-degraded")
        spec.lmcache_config["extra_config"]["pcp_shard_store"] = False
        spec.cpu_connector = False
        with pytest.raises(EngineError, match=r"degraded mode") as raised:
            engines.start(spec)
        assert "No supported cpu connector found" in str(raised.value)
        assert valkey.client().dbsize() == 0
    finally:
        valkey.stop()
