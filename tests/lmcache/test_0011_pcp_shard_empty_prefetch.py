"""0011: under async loading, a rank that owns no chunk of a prompt answers
its prefetch without asking any tier.

The rank's prefetch has no key to look up (fewer chunks than ranks). Before,
the storage manager still asked every backend: the remote one sent an empty
batch to the RESP client, which rejects it, and a warning was logged per
request. Now it answers at once with the end of the prompt's chunks, as it
did after the failed call.

The ranks are LMCache's real engines (a prefetch uses no collective, so the
PCP collectives are given but never called) with L1 and a real Valkey through
the native RESP client, whose calls Valkey's INFO commandstats counts. They
run in a process of their own: closing an engine with a RESP remote blocks in
upstream's RESPConnector.close, so the process exits instead. LMCache's
loggers do not propagate; a handler is attached to them there.
"""

from __future__ import annotations

import pytest

from tests.lmcache import pcp_scenarios as S
from tests.lmcache.test_0009_pcp_shard_lookup_logs import Records
from tests.support.pcp_ranks import CHUNK_SIZE, build_engine, run_processes

pytestmark = pytest.mark.lmcache

ASYNC = "0011-pcp-shard-async-load.patch"


def prefetch_rank(rank: int, world_size: int, workdir: str, url: str, valkey_port: int) -> dict:
    """PCP ranks 3 and 1 of 4 prefetch a 2-chunk prompt whose chunks ranks 0
    and 1 own; report each one's answer, its EXISTS calls and the warnings."""
    import torch
    import valkey

    from lmcache.v1.pcp_collectives import PCPCollectives

    def built(pcp_rank: int):
        collectives = PCPCollectives(pcp_rank, 4, None, None, None, torch.device("cpu"))
        engine, _, responses = build_engine(
            pcp_rank, 4, collectives, instance_id=f"prefetch-{pcp_rank}", remote_url=url, l1_gb=0.01, async_loading=True
        )
        S.storage_of(engine)
        return engine, responses

    def exists_calls() -> int:
        stats = valkey.Valkey(host="127.0.0.1", port=valkey_port).info("commandstats")
        return int(stats.get("cmdstat_exists", {}).get("calls", 0))

    tokens = S.prompt_tokens(90, 2)
    (idle, idle_responses), (owner, owner_responses) = built(3), built(1)
    records = Records()
    result = {}
    for name, engine, responses in (("idle", idle, idle_responses), ("owner", owner, owner_responses)):
        before = exists_calls()
        records.messages.clear()
        engine.async_lookup_and_prefetch(f"prefetch-{name}", tokens)
        answer = responses.wait(f"prefetch-{name}")
        result[name] = (answer, exists_calls() - before, list(records.messages))
    return result


@pytest.mark.fixes(ASYNC, fails_with=r"keys list is empty|sent \d+ EXISTS calls")
def test_a_rank_that_owns_no_chunk_answers_its_prefetch_without_asking_valkey(valkey, tmp_path):
    result = run_processes(1, prefetch_rank, tmp_path, timeout_s=120, url=valkey.url, valkey_port=valkey.port)[0]
    answer, exists, warnings = result["idle"]
    assert exists == 0, f"rank 3 sent {exists} EXISTS calls for a prompt it owns no chunk of"
    assert warnings == [], f"rank 3 logged warnings for a prefetch it has nothing to ask: {warnings}"
    assert answer == 2 * CHUNK_SIZE  # nothing of its own is missing
    # the control: a rank that owns a chunk missing from its L1 asks Valkey,
    # and answers the start of that chunk
    answer, exists, _ = result["owner"]
    assert (answer, exists >= 1) == (CHUNK_SIZE, True), result["owner"]
