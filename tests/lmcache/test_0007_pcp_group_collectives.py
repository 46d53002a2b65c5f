"""Proof of 0007-vllm-pcp-group-collectives.patch.

Two ranks of a real vLLM PCP group (PCP = 2, TP = 1, gloo on CPU; see
tests/lmcache/vllm_pcp_scenarios.py) get their engines from LMCache's real
VllmServiceFactory. Under MLA the default store is rank 0's
(save_only_first_rank), and a retrieve broadcasts rank 0's chunks to the
others. Pristine LMCache takes the broadcasts from vLLM's TP group, which has
one rank here, so rank 1 receives nothing and loads nothing; with the patch
the broadcasts run over the PCP group and rank 1 loads the whole prompt,
byte for byte.
"""

from __future__ import annotations

import pytest

from tests.lmcache import vllm_pcp_scenarios
from tests.support.pcp_ranks import CHUNK_SIZE, run_processes

pytestmark = pytest.mark.lmcache

PATCH = "0007-vllm-pcp-group-collectives.patch"


@pytest.mark.fixes(PATCH, fails_with=r"AssertionError: tokens loaded per rank \[64, 0\]")
def test_rank_zero_store_reaches_every_pcp_rank(tmp_path):
    num_chunks = 4
    results = run_processes(
        2, vllm_pcp_scenarios.rank_zero_store_then_load, tmp_path, timeout_s=240, num_chunks=num_chunks
    )
    loaded = [r["loaded"] for r in results]
    assert loaded == [num_chunks * CHUNK_SIZE] * 2, f"tokens loaded per rank {loaded}: {results}"
    assert all(r["kv_ok"] for r in results)
