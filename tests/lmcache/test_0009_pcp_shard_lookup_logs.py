"""0009: lookups under the PCP-sharded store ask only what there is to ask,
and log a warning only for what is not expected.

* A rank that owns no chunk of a prompt (fewer chunks than ranks) has nothing
  to ask its tiers: it answers without a remote call. Before, it sent an empty
  batch to the RESP client, which rejects it, and logged a warning per lookup.
* Under the sharded store each rank answers the start of its first missing
  own chunk, so the ranks' answers differ whenever the cached prefix is shorter
  than the prompt. That is the design, not a fault: the scheduler's lookup
  client logs it at DEBUG. An answer the layout does not explain (a rank that
  does not own chunk 0 answering 0: a failed lookup) still logs a WARNING.

The ranks are LMCache's real engines, one per PCP rank (a lookup uses no
collective, so the PCP collectives are given but never called), with L1 and,
for the remote tier, a real Valkey through the native RESP client, whose calls
Valkey's INFO commandstats counts; the lookup servers and the scheduler's
client are LMCache's real ZMQ ones. LMCache's loggers do not propagate, so a
handler (caplog's, in this process) is attached to them.
"""

from __future__ import annotations

import itertools
import logging
import os

import pytest
import torch

from tests.lmcache import pcp_scenarios as S
from tests.support.pcp_ranks import CHUNK_SIZE, build_engine, run_processes

pytestmark = pytest.mark.lmcache

STORE = "0009-pcp-shard-store-and-lookup.patch"
_ids = itertools.count()


@pytest.fixture
def lmcache_log(caplog):
    """caplog, attached to every LMCache logger (they do not propagate)."""
    import lmcache.v1.cache_engine  # noqa: F401 - creates the engine's loggers
    import lmcache.v1.lookup_client.lmcache_lookup_client  # noqa: F401

    loggers = [
        logger
        for name, logger in list(logging.Logger.manager.loggerDict.items())
        if name.startswith("lmcache") and isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        for logger in loggers:
            logger.removeHandler(caplog.handler)


def warnings_of(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def engines(request):
    """build(rank, world_size, **options): an engine of PCP rank ``rank``;
    all are destroyed afterwards."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.pcp_collectives import PCPCollectives

    built = []

    def build(rank: int, world_size: int, **options):
        instance_id = f"lookup-logs-{os.getpid()}-{next(_ids)}"
        built.append(instance_id)
        collectives = PCPCollectives(rank, world_size, None, None, None, torch.device("cpu"))
        engine, kv, responses = build_engine(rank, world_size, collectives, instance_id=instance_id, **options)
        S.storage_of(engine)
        return engine, kv, responses

    yield build
    for instance_id in built:
        LMCacheEngineBuilder.destroy(instance_id)


class Records(logging.Handler):
    """The WARNING records of every LMCache logger (they do not propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            if name.startswith("lmcache") and isinstance(logger, logging.Logger):
                logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


def lookup_from_ranks_rank(rank: int, world_size: int, workdir: str, url: str, valkey_port: int) -> dict:
    """In a process of its own (closing an engine with a RESP remote blocks in
    RESPConnector.close, upstream's: the process exits instead): PCP ranks 3
    and 1 of 4 look up a 2-chunk prompt whose chunks ranks 0 and 1 own; report
    what each asked Valkey and what was logged."""
    import valkey

    from lmcache.v1.pcp_collectives import PCPCollectives

    def built(pcp_rank: int):
        collectives = PCPCollectives(pcp_rank, 4, None, None, None, torch.device("cpu"))
        engine, _, _ = build_engine(
            pcp_rank, 4, collectives, instance_id=f"lookup-{pcp_rank}", remote_url=url, l1_gb=0.01
        )
        S.storage_of(engine)
        return engine

    def exists_calls() -> int:
        stats = valkey.Valkey(host="127.0.0.1", port=valkey_port).info("commandstats")
        return int(stats.get("cmdstat_exists", {}).get("calls", 0))

    tokens = S.prompt_tokens(80, 2)
    idle, owner = built(3), built(1)
    records = Records()
    before = exists_calls()
    idle_answer = idle.lookup(tokens)
    idle_exists = exists_calls() - before
    idle_warnings = list(records.messages)
    before = exists_calls()
    owner_answer = owner.lookup(tokens)
    return {
        "idle": (idle_answer, idle_exists, idle_warnings),
        "owner": (owner_answer, exists_calls() - before),
    }


@pytest.mark.fixes(STORE, fails_with=r"has no storage manager: MLA stores on rank 0 only|keys list is empty")
def test_a_rank_that_owns_no_chunk_answers_without_asking_valkey(valkey, tmp_path):
    result = run_processes(
        1, lookup_from_ranks_rank, tmp_path, timeout_s=120, url=valkey.url, valkey_port=valkey.port
    )[0]
    answer, exists, warnings = result["idle"]
    assert answer == 2 * CHUNK_SIZE  # nothing of its own is missing
    assert exists == 0, f"rank 3 sent {exists} EXISTS calls for a prompt it owns no chunk of"
    assert warnings == [], f"rank 3 logged warnings for a lookup it has nothing to ask: {warnings}"
    # the control: a rank that owns a chunk missing from its L1 asks Valkey
    answer, exists = result["owner"]
    assert answer == CHUNK_SIZE and exists >= 1, result["owner"]


def start_lookup_group(engines, world_size: int, engine_id: str):
    """W sharded ranks with their real lookup servers, and the scheduler's
    real lookup client that asks every server."""
    import dataclasses

    from lmcache.v1.lookup_client.factory import LookupClientFactory
    from tests.support.pcp_ranks import MODEL, mla_metadata

    ranks, servers = [], []
    for rank in range(world_size):
        engine, kv, _ = engines(rank, world_size, l1_gb=0.01)
        server = LookupClientFactory.create_lookup_server(
            engine, dataclasses.replace(engine.metadata, engine_id=engine_id)
        )
        assert server is not None, f"rank {rank} runs no lookup server"
        ranks.append((engine, kv))
        servers.append(server)
    scheduler = dataclasses.replace(
        mla_metadata(MODEL, world_size, 0, pcp_world_size=world_size), role="scheduler", engine_id=engine_id
    )
    client = LookupClientFactory.create_lookup_client(ranks[0][0].config, scheduler)
    return ranks, servers, client


@pytest.mark.fixes(STORE, fails_with=r"has no storage manager: MLA stores on rank 0 only|differ across")
def test_expected_per_rank_answers_log_at_debug_and_unexplained_ones_warn(engines, lmcache_log):
    world_size, num_chunks = 4, 9
    ranks, servers, client = start_lookup_group(engines, world_size, f"lookup-logs-{os.getpid()}")
    lmcache_log.set_level(logging.DEBUG, logger="lmcache.v1.lookup_client.lmcache_lookup_client")
    try:
        tokens = S.prompt_tokens(81, num_chunks)
        for engine, kv in ranks:
            kv.fill(81, len(tokens))
            engine.store(tokens)
        # chunk 5 evicted from its owner (rank 1): the cached prefix is 5 chunks
        owner = ranks[1][0]
        for start, _end, key in owner.token_database.process_tokens(tokens=tokens):
            if start == 5 * CHUNK_SIZE:
                owner.storage_manager.remove(key)

        lmcache_log.clear()
        assert client.lookup(tokens, lookup_id="partial") == 5 * CHUNK_SIZE
        logged = warnings_of(lmcache_log)
        assert logged == [], f"an expected per-rank partial hit logged a warning: {logged}"
        debug = [
            r.getMessage() for r in lmcache_log.records if r.levelno == logging.DEBUG and "per rank" in r.getMessage()
        ]
        assert debug, "the per-rank answers are not logged at DEBUG"

        # rank 2 fails its lookup (unhealthy: a deliberate fake, a health
        # monitor cannot be flipped on demand) and answers 0, a chunk it does
        # not own: that is not the layout's doing and stays a warning
        ranks[2][0].is_healthy = lambda: False
        lmcache_log.clear()
        assert client.lookup(tokens, lookup_id="failed") == 0
        assert any("differ across" in w for w in warnings_of(lmcache_log)), warnings_of(lmcache_log)
    finally:
        client.close()
        for server in servers:
            server.close()
