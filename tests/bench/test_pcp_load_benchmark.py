"""Smoke test of benchmarks/pcp_load_path.py on real ranks.

Runs the benchmark end to end at its smallest size (W = 2, one layer, one
repetition) for three prompt lengths, with a staging buffer small enough
that an owner's chunks take more than one piece, and checks the counted
collectives in its table and JSON against what the sharded load does with
the chunks and the staging buffer of that run: one tensor broadcast per
piece of each owner's chunks, an all-gather before and after, and one load
stream synchronize per piece; the rank-0 path one object broadcast per
chunk plus the count, and one tensor broadcast per chunk. The expected
figures are derived here from the run's own chunk count, chunk size and
staging buffer, so they grow with the pieces. It asserts nothing about
speed (a timed test on a shared 2-core machine would be noise).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lmcache

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "pcp_load_path.py"
WORLD_SIZE = 2
PROMPTS = (2048, 4096, 6144)  # 8, 16 and 24 chunks of 256 tokens
LAYERS = 1
BUFFER_MB = 60.0  # at 78 layers: five 12.2 MB chunks per piece
FULL_LAYERS = 78


def run_benchmark(tmp_path: Path) -> tuple[str, list[dict]]:
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(SCRIPT), "--world-sizes", str(WORLD_SIZE),
           "--prompts", ",".join(map(str, PROMPTS)), "--layers", str(LAYERS),
           "--buffer-mb", str(BUFFER_MB), "--repetitions", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def table_collectives(stdout: str) -> dict[tuple[int, str], int]:
    """(tokens, mode) -> the 'colls' column of the printed table."""
    found = {}
    for line in stdout.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[0] == str(WORLD_SIZE) and fields[2] in ("rank-0", "sharded"):
            found[(int(fields[1].replace(",", "")), fields[2])] = int(fields[4])
    return found


def owned_chunks(chunks: int) -> list[int]:
    return [sum(1 for c in range(chunks) if c % WORLD_SIZE == owner) for owner in range(WORLD_SIZE)]


def test_counted_collectives_follow_the_pieces_of_the_sharded_load(tmp_path):
    stdout, rows = run_benchmark(tmp_path)
    printed = table_collectives(stdout)
    assert "1 of 78" in stdout and "scripts/kvsizing/geometry.py" in stdout
    assert [(r["tokens"], r["mode"]) for r in rows] == [(t, m) for t in PROMPTS for m in ("rank-0", "sharded")]

    sharded_totals = []
    for row in rows:
        chunks = row["chunks"]
        assert row["verified"] and row["same_collectives_on_every_rank"]
        assert row["loaded_tokens"] == chunks * 256
        assert printed[(row["tokens"], row["mode"])] == row["collectives_total"]
        if row["mode"] == "rank-0":
            assert row["collectives"] == {"broadcast_object_list": chunks + 1, "broadcast": chunks}
            assert row["bytes_by_owner"] == {"0": chunks * row["chunk_bytes"]}
            continue
        # The staging buffer: the largest owner's share, capped at the
        # scaled pcp_shard_load_buffer_mb, never under one chunk.
        limit = int(BUFFER_MB * LAYERS / FULL_LAYERS * 1024**2)
        share = math.ceil(chunks / WORLD_SIZE) * row["chunk_bytes"]
        assert row["staging_capacity_bytes"] == max(row["chunk_bytes"], min(share, limit))
        per_piece = row["staging_capacity_bytes"] // row["chunk_bytes"]
        pieces = sum(math.ceil(n / per_piece) for n in owned_chunks(chunks))
        assert row["collectives"] == {"all_gather_object": 2, "broadcast": pieces}
        assert row["collectives_total"] == pieces + 2
        assert row["host_syncs_total"] == pieces and row["batched_to_gpu_calls"] == pieces
        assert row["bytes_by_owner"] == {
            str(owner): n * row["chunk_bytes"] for owner, n in enumerate(owned_chunks(chunks))}
        sharded_totals.append((pieces, row["collectives_total"]))
    # More chunks than one piece per owner holds: the count grows with the pieces.
    assert [p for p, _ in sharded_totals] == sorted({p for p, _ in sharded_totals}) and len(sharded_totals) == 3
    assert [t for _, t in sharded_totals] == sorted({t for _, t in sharded_totals})
