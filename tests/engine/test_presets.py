"""The presets, run: configs/aggregated on the CPU overlay, and LMCache's degraded mode caught.

configs/prefill runs in test_protocol.py (and at TP 2 in test_tp2.py).

The three engines of this file are independent, so their starts run at once
(``starts``): an engine start is mostly three Python processes importing
one after the other, so two cores start them in about the time of one and a
half. Each engine has its own ports, Valkey, work folder and NIXL
side-channel port (two prefill engines at once would otherwise both bind
vLLM's default 5600). What each test asserts is unchanged.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.engine.conftest import Engines
from tests.engine.prompts import PROMPT, same_output
from tests.support import cpu_overlay
from tests.support import engine as engine_support
from tests.support.engine import EngineError, observe
from tests.support.ports import free_port_block
from tests.support.valkey import ValkeyServer, start_valkey

# Three starts share two cores: each is bounded at 1.5 times one start's bound.
STARTUP_TIMEOUT_S = 1.5 * engine_support.STARTUP_TIMEOUT_S
START_WAIT_S = STARTUP_TIMEOUT_S + 60


@pytest.fixture(scope="module")
def starts(engine_python, tiny_model, tmp_path_factory):
    """The file's three engine starts, launched together: name -> (future server, spec, its Valkey)."""
    specs: dict[str, tuple] = {"aggregated": (cpu_overlay.cpu_spec("aggregated", tiny_model), None)}
    valkeys: list[ValkeyServer] = []
    try:
        for name in ("prefill-no-cpu-connector", "prefill-degraded"):
            base = free_port_block(1)
            valkeys.append(start_valkey(tmp_path_factory.mktemp(f"{name}-valkey"), port=base))
            spec = cpu_overlay.cpu_spec("prefill", tiny_model, base, label=name)
            spec.cpu_connector = False
            specs[name] = (spec, valkeys[-1])
        # Outside shard mode LMCache degrades instead of failing the start.
        specs["prefill-degraded"][0].lmcache_config["extra_config"]["pcp_shard_store"] = False
        engines = {name: Engines(engine_python, tmp_path_factory.mktemp(name)) for name in specs}
        with ThreadPoolExecutor(len(specs)) as pool:
            futures: dict[str, Future] = {
                name: pool.submit(engines[name].start, spec, startup_timeout_s=STARTUP_TIMEOUT_S)
                for name, (spec, _) in specs.items()}
            try:
                yield {name: (futures[name], *specs[name]) for name in specs}
            finally:
                for future in futures.values():
                    future.exception(timeout=START_WAIT_S)   # every start over before anything stops
                for started in engines.values():
                    started.stop_all()
    finally:
        for valkey in valkeys:
            valkey.stop()


@pytest.mark.engine
def test_aggregated_preset_serves(starts):
    """No connector: vLLM's CPU MLA turns its own prefix cache off, so both runs are cold."""
    started, spec, _ = starts["aggregated"]
    assert spec.lmcache_config is None and "kv-transfer-config" not in spec.vllm_config
    server = started.result(timeout=START_WAIT_S)
    first, second = observe(server, [], PROMPT), observe(server, [], PROMPT)
    same_output(first, second)
    assert not first.counts.lines and not second.counts.lines
    log = server.log_text()
    assert "Using CPU_MLA backend" in log and "LMCacheConnectorV1" not in log


@pytest.mark.engine
def test_lmcache_init_failure_stops_the_sharded_prefill_engine(starts):
    """Without the CPU connector LMCache's init fails ("No supported cpu connector
    found"). With the prefill preset's pcp_shard_store that is fatal (patch 0012): the
    engine core fails while starting, naming the cause, instead of one rank degrading alone.
    The server then exits, or, when vLLM's shutdown loses a worker's SIGTERM, is stopped by
    the harness (tests/support/engine.py, CORE_FAILED_EXIT_S): either way it never serves."""
    started, spec, valkey = starts["prefill-no-cpu-connector"]
    assert spec.lmcache_config["extra_config"]["pcp_shard_store"] is True and not spec.cpu_connector
    with pytest.raises(EngineError,
                       match=r"exited with \d+ while starting|engine core failed while starting") as raised:
        started.result(timeout=START_WAIT_S)
    log = raised.value.log_text
    assert "No supported cpu connector found" in log
    assert "degraded mode" not in log
    assert valkey.client().dbsize() == 0


@pytest.mark.engine
def test_degraded_lmcache_fails_the_harness(starts):
    """Outside shard mode LMCache switches itself off while the server starts and
    answers (upstream's degraded mode): the harness must refuse such an engine, naming
    the cause, as soon as LMCache logs it (the start does not wait for the server to
    answer). The prefill preset with pcp_shard_store off, without the CPU connector."""
    started, spec, valkey = starts["prefill-degraded"]
    assert spec.lmcache_config["extra_config"]["pcp_shard_store"] is False and not spec.cpu_connector
    with pytest.raises(EngineError, match=r"degraded mode") as raised:
        started.result(timeout=START_WAIT_S)
    assert "No supported cpu connector found" in str(raised.value)
    assert valkey.client().dbsize() == 0
