"""Store critical path under PCP: rank-0 store vs the PCP-sharded store.

What it measures
----------------
For W ranks of a real PCP group (processes, gloo, LMCache's real engine and
L1 on CPU; the paged GPU KV cache is a CPU tensor per rank), each rank holds
the whole prompt's MLA KV as after the all-gather and calls
``LMCacheEngine.store`` for the prompt, once with the upstream rank-0 store
(``save_only_first_rank``, MLA's default) and once with
``pcp_shard_store``. Per rank: the bytes it copied into L1 and the wall time
of its ``store`` call. The step waits for the slowest rank, so the table
reports the maximum over the ranks.

Both engines live in the same rank processes and the two modes alternate
every repetition, so machine noise falls on both alike. L1 buffers are made resident
before timing, as pinned memory is on a GPU node. The ranks store one
at a time (a barrier between them): on a GPU node every rank has its own
GPU and host cores, while here W ranks share two cores, and timing them
concurrently would measure the contention of this machine instead.

Output: one row per (W, mode): bytes per rank (max and mean, their ratio),
the median over repetitions of the slowest rank's store time (wall, and CPU
time of the storing thread: the copy runs in that thread, and CPU time does
not count the time other jobs on this shared machine take the core), and
per W the ratio rank-0 / sharded of the CPU time, which the goal uses. Goals (the sharded store's): sharded
max/mean bytes <= 1 + one chunk's share of the mean, and the slowest rank's
time reduced close to W times. Writes a JSON next to the table when --json
is given. Exit status 0 when both goals hold, 3 when a goal is missed.

Run: ``PYTHONPATH=. work/venv/bin/python benchmarks/pcp_store_critical_path.py
--json work/bench/pcp_store.json --png work/bench/pcp_store.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.pcp_ranks import run_processes  # noqa: E402

# One chunk of an MLA model: 256 tokens x (512 + 64) latent dims, bf16, per
# layer (GLM-5.3's full chunk, indexer included, is 12.2 MB: kvsizing/geometry.py);
# --layers 12 makes 3.5 MB chunks, enough
# for the copy to dominate each rank's fixed per-call cost (every rank hashes
# the whole prompt's chunk chain, owned or not) without using GBs of RAM.
CHUNK_TOKENS = 256
HEAD = 576


def rank_store(rank: int, world_size: int, workdir: str, num_chunks: int, repetitions: int,
               layers: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lmcache.v1.pcp_collectives import PCPCollectives
    from tests.support.pcp_ranks import build_engine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
    ranks = list(range(world_size))
    cpu_group = dist.new_group(ranks, backend="gloo")
    collectives = PCPCollectives.from_process_groups(ranks, cpu_group, dist.new_group(ranks, backend="gloo"),
                                                     torch.device("cpu"))
    prompt_tokens = num_chunks * CHUNK_TOKENS
    chunk_bytes = layers * CHUNK_TOKENS * HEAD * 2
    pod_gb = (repetitions + 1) * num_chunks * chunk_bytes / 1024**3 * 1.25
    shape = dict(num_layers=layers, head_size=HEAD, chunk_size=CHUNK_TOKENS, max_tokens=prompt_tokens)
    engines = {}
    for mode, shard in (("rank-0 store", False), ("sharded", True)):
        engine, kv, _ = build_engine(
            rank, world_size, collectives, instance_id=f"bench-{mode}-{rank}", shard=shard,
            l1_gb=pod_gb, first_rank_l1_gb=pod_gb, **shape,
        )
        kv.fill(7, prompt_tokens)
        _make_l1_resident(engine)
        engines[mode] = engine, kv
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    cpu_times: dict[str, list[float]] = {mode: [] for mode in engines}
    stored_bytes: dict[str, int] = {mode: 0 for mode in engines}
    for rep in range(repetitions):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for mode in order:
            engine, _kv = engines[mode]
            tokens = [(rep * 100003 + 7 * i) % 65521 for i in range(prompt_tokens)]
            elapsed = cpu = 0.0
            for turn in range(world_size):
                dist.barrier(group=cpu_group)
                if turn == rank:
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    engine.store(tokens)
                    elapsed = time.perf_counter() - start
                    cpu = time.thread_time() - start_cpu
            dist.barrier(group=cpu_group)
            times[mode].append(elapsed)
            cpu_times[mode].append(cpu)
            if rep == 0:
                stored_bytes[mode] = _l1_bytes(engine, tokens)
    return {"times": times, "cpu_times": cpu_times, "bytes": stored_bytes, "chunk_bytes": chunk_bytes}


def _make_l1_resident(engine) -> None:
    """Touch every page of this rank's L1 buffer once.

    On a GPU node LMCache's L1 is pinned host memory, resident from init;
    here it is ordinary memory that the kernel maps on first write, and a
    first write costs several times a warm copy. Without this the table
    would compare page-fault rates, not stores."""
    if engine.storage_manager is None:
        return
    allocator = engine.storage_manager.storage_backends["LocalCPUBackend"].memory_allocator
    buffer = getattr(allocator, "buffer", None)
    if buffer is None:
        raise RuntimeError(f"{type(allocator).__name__} has no .buffer to make resident")
    buffer.zero_()


def _l1_bytes(engine, tokens) -> int:
    if engine.storage_manager is None:  # a passive rank of the rank-0 store
        return 0
    backend = engine.storage_manager.storage_backends["LocalCPUBackend"]
    total = 0
    for _start, _end, key in engine.token_database.process_tokens(tokens=tokens):
        if backend.contains(key):
            total += backend.hot_cache[key].get_size()
    return total


def summarize(world_size: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    chunk_bytes = per_rank[0]["chunk_bytes"]
    for mode in per_rank[0]["times"]:
        per_rank_bytes = [r["bytes"][mode] for r in per_rank]
        repetitions = len(per_rank[0]["times"][mode])
        slowest = [max(r["times"][mode][i] for r in per_rank) for i in range(repetitions)]
        slowest_cpu = [max(r["cpu_times"][mode][i] for r in per_rank) for i in range(repetitions)]
        mean_bytes = statistics.fmean(per_rank_bytes)
        rows.append(
            {
                "W": world_size,
                "mode": mode,
                "bytes_max": max(per_rank_bytes),
                "bytes_mean": mean_bytes,
                "bytes_max_over_mean": max(per_rank_bytes) / mean_bytes,
                "bytes_goal": 1.0 + chunk_bytes / mean_bytes,
                "slowest_store_s": statistics.median(slowest),
                "slowest_store_cpu_s": statistics.median(slowest_cpu),
            }
        )
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({row["W"] for row in rows})
    modes = ["rank-0 store", "sharded"]
    fig, (ax_bytes, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for offset, mode in zip((-width / 2, width / 2), modes):
        picked = [next(r for r in rows if r["W"] == w and r["mode"] == mode) for w in sizes]
        xs = [i + offset for i in range(len(sizes))]
        ax_bytes.bar(xs, [r["bytes_max"] / 1e6 for r in picked], width, label=mode)
        ax_time.bar(xs, [r["slowest_store_cpu_s"] * 1e3 for r in picked], width, label=mode)
    for ax, title, unit in (
        (ax_bytes, "bytes copied by the busiest rank", "MB"),
        (ax_time, "slowest rank's store (CPU time, median)", "ms"),
    ):
        ax.set_xticks(range(len(sizes)), [f"W={w}" for w in sizes])
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.25)  # room for the legend
        ax.legend(loc="upper right")
    fig.suptitle("Store critical path under PCP: rank-0 store vs PCP-sharded store")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--chunks", type=int, default=64,
                        help="prompt length in chunks of 256 tokens (default 64: 16k tokens)")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--layers", type=int, default=12, help="layers per chunk (12: 3.5 MB chunks)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path, help="bar charts of bytes per rank and the slowest rank's store time")
    args = parser.parse_args(argv)

    rows: list[dict[str, Any]] = []
    for world_size in [int(w) for w in args.world_sizes.split(",")]:
        print(f"W={world_size}: {world_size} ranks, {args.chunks} chunks, {args.repetitions} repetitions ...",
              flush=True)
        with tempfile.TemporaryDirectory(prefix=f"pcp-bench-{world_size}-") as workdir:
            per_rank = run_processes(
                world_size, rank_store, Path(workdir), timeout_s=900,
                num_chunks=args.chunks, repetitions=args.repetitions, layers=args.layers,
            )
        rows.extend(summarize(world_size, per_rank))

    ok = True
    print()
    print(f"{'W':>2}  {'mode':<13} {'max MB/rank':>11} {'mean MB/rank':>12} {'max/mean':>8} "
          f"{'slowest wall ms':>15} {'slowest CPU ms':>14} {'rank-0/sharded (CPU)':>20}")
    for row in rows:
        ratio = ""
        if row["mode"] == "sharded":
            base = next(r for r in rows if r["W"] == row["W"] and r["mode"] == "rank-0 store")
            row["speedup_wall"] = base["slowest_store_s"] / row["slowest_store_s"]
            row["speedup"] = base["slowest_store_cpu_s"] / row["slowest_store_cpu_s"]
            ratio = f"{row['speedup']:.2f}x"
            if row["bytes_max_over_mean"] > row["bytes_goal"] + 1e-9:
                ok = False
        print(
            f"{row['W']:>2}  {row['mode']:<13} {row['bytes_max'] / 1e6:>11.1f} {row['bytes_mean'] / 1e6:>12.1f} "
            f"{row['bytes_max_over_mean']:>8.2f} {row['slowest_store_s'] * 1e3:>15.1f} "
            f"{row['slowest_store_cpu_s'] * 1e3:>14.1f} {ratio:>20}"
        )
    for row in rows:
        if row["mode"] == "sharded":
            print(
                f"W={row['W']}: sharded bytes max/mean {row['bytes_max_over_mean']:.3f} "
                f"(goal <= {row['bytes_goal']:.3f}); "
                f"slowest-rank store CPU time {row['speedup']:.2f}x lower than the rank-0 store's "
                f"(wall {row['speedup_wall']:.2f}x; ideal {row['W']}x)"
            )
            if row["speedup"] < 0.5 * row["W"]:
                ok = False
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    if args.png:
        plot(rows, args.png)
        print(f"wrote {args.png}")
    print("goals met" if ok else "GOAL MISSED")
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
