"""Load path under PCP: the rank-0 retrieve vs the PCP-sharded retrieve.

What it measures
----------------
For W ranks of a real PCP group (processes, gloo, LMCache's real engine and
L1 on CPU; the paged GPU KV cache is a CPU tensor per rank), the prompt's
MLA KV is stored once by each of two engines per rank: the upstream rank-0
store (``save_only_first_rank``, MLA's default: rank 0 holds every chunk)
and the PCP-sharded store (``pcp_shard_store``: chunk c lives on rank
c mod W). Then every rank calls ``LMCacheEngine.retrieve`` for the whole
prompt, with each engine in turn:

* rank-0 path: rank 0 reads every chunk and broadcasts, per chunk, its
  metadata (an object broadcast) and its bytes (a tensor broadcast); the
  other ranks write what they received to the paged KV cache at the end;
* sharded path (``_pcp_shard_load``): one all-gather of what each rank
  read, then per owner, in rank order, one tensor broadcast per piece of
  its chunks that fits the staging buffer (the owner copies the piece into
  the buffer, every rank writes it to the paged KV cache and synchronizes
  the load stream before the next piece), then one all-gather of the
  prefix each rank wrote.

Counted, not assumed: while a rank is inside ``retrieve`` this process
wraps ``torch.distributed``'s collectives (a collective that calls another
internally counts once), every ``synchronize`` of ``torch.cuda``,
``torch.cpu``, ``torch.accelerator``, their Stream and Event classes and
LMCache's ``torch_dev`` and ``broadcast_stream``, every blocking
``Tensor.to(device)``, the connector's ``batched_to_gpu`` calls and the
size of the sharded load's staging buffer. The tensor broadcasts' sources
and sizes give the bytes per owner. Every rank must log the same
collectives in the same order, the counts must not change between
repetitions, and every rank's paged KV cache must hold the stored prompt
byte for byte after the first retrieve of each mode; otherwise the run
exits with status 1.

Geometry: GLM-5.3's chunk size and bytes per token and layer come from
``scripts/kvsizing/geometry.py`` (the project's source of truth). The
prompt keeps its real chunk count (16,384 tokens: 64 chunks; 200,000
tokens: 781 full chunks), which is what sets the number of collectives.
The layer count is scaled down to fit --mem-gb on this machine (W ranks
each hold the whole prompt's KV, the rank-0 path's receive buffers and
their L1), and the staging buffer cap (``pcp_shard_load_buffer_mb``,
LMCache's default 256 MiB; the presets leave it unset) is scaled by the
same factor, so that a piece holds as many chunks as at 78 layers. Bytes
are printed as measured and as at 78 layers.

On CPU there is no device: the staging buffer and the paged KV cache are
CPU memory, the "host-to-device" copies are CPU copies, a stream
synchronize returns at once, and the tensor broadcasts go over gloo on
loopback, not NCCL. All W ranks run at once (a retrieve is collective) on
this machine's cores, so the wall times of the larger W include the
contention of W processes for two cores. The wall time is the median over
repetitions of the slowest rank's ``retrieve``; the two modes alternate
every repetition.

Output: one row per (W, prompt, mode), the two modes side by side with the
ratio rank-0 / sharded of collectives and wall time. Progress goes to
stderr. Writes a JSON next to the table when --json is given (under
work/, which git ignores).

Run: ``PYTHONPATH=. work/venv/bin/python benchmarks/pcp_load_path.py
--json work/bench/pcp_load.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(REPO / "scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "scripts"))

from kvsizing import geometry  # noqa: E402
from tests.support.pcp_ranks import run_processes  # noqa: E402

GEOMETRY_SOURCE = "scripts/kvsizing/geometry.py"
CHUNK_TOKENS = geometry.CHUNK_TOKENS  # LMCache chunk_size of the presets
FULL_LAYERS = geometry.LAYERS
# The stand-in paged KV cache is one bf16 tensor per layer, so every layer gets the same row: GLM-5.3's bytes
# per token (78 latent rows of 576 B and 21 DSA indexer rows of 132 B: 47,700 B) over its 78 layers, 611.5 B,
# rounded up to an even 612 B (a chunk at 78 layers then 0.08% over the real one). One token of one layer is
# ROW_BYTES / 2 elements.
ROW_BYTES = 2 * -(-geometry.KV_BYTES_PER_TOKEN // (2 * FULL_LAYERS))
HEAD = ROW_BYTES // 2
assert HEAD * 2 == ROW_BYTES, "the bf16 stand-in needs an even row size"
FULL_CHUNK_BYTES = geometry.CHUNK_BYTES
DEFAULT_BUFFER_MB = 256.0  # LMCache's pcp_shard_load_buffer_mb default (patch 0010)
MODES = ("rank-0", "sharded")
SEED = 7

# torch.distributed functions counted as collectives when called directly.
COLLECTIVES = (
    "broadcast", "broadcast_object_list", "all_gather_object", "all_gather",
    "all_gather_into_tensor", "all_reduce", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
    "scatter_object_list", "reduce", "barrier", "send", "recv", "isend", "irecv",
)


# --------------------------------------------------------------------------
# Instrumentation (inside a rank process)
# --------------------------------------------------------------------------


@dataclass
class Probe:
    """Counts what the armed thread does while it is armed: collectives,
    host synchronize calls, blocking copies to a device, the connector's
    batched_to_gpu calls and the staging buffers the sharded load allocates.
    A wrapped call made from inside another wrapped call counts once."""

    armed: int | None = None
    depth: int = 0
    collectives: list[tuple[str, int | None, int | None]] = field(default_factory=list)
    syncs: Counter = field(default_factory=Counter)
    blocking_to: int = 0
    to_gpu_calls: int = 0
    staging_bytes: list[int] = field(default_factory=list)

    def arm(self) -> None:
        self.collectives, self.syncs = [], Counter()
        self.blocking_to = self.to_gpu_calls = 0
        self.staging_bytes = []
        self.armed = threading.get_ident()

    def disarm(self) -> dict[str, Any]:
        self.armed = None
        return {
            "collectives": list(self.collectives),
            "syncs": dict(self.syncs),
            "blocking_to": self.blocking_to,
            "to_gpu_calls": self.to_gpu_calls,
            "staging_bytes": list(self.staging_bytes),
        }

    def counting(self) -> bool:
        return self.armed == threading.get_ident() and self.depth == 0

    def wrap(self, owner: Any, name: str, record: Callable[..., None]) -> bool:
        """Replace ``owner.name`` with a wrapper that calls ``record(*args,
        **kwargs)`` when counting. Returns False when there is nothing to
        wrap or it is wrapped already."""
        original = getattr(owner, name, None)
        if original is None or getattr(original, "_load_probe", False):
            return False
        probe = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not probe.counting():
                return original(*args, **kwargs)
            record(*args, **kwargs)
            probe.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                probe.depth -= 1

        wrapper._load_probe = True  # type: ignore[attr-defined]
        setattr(owner, name, wrapper)
        return True

    def install_collectives(self, dist: Any) -> None:
        for name in COLLECTIVES:
            self.wrap(dist, name, self._collective_recorder(name))

    def _collective_recorder(self, name: str) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            src = kwargs.get("src", args[1] if len(args) > 1 and isinstance(args[1], int) else None)
            nbytes = None
            tensor = kwargs.get("tensor", args[0] if args else None)
            if name == "broadcast" and hasattr(tensor, "element_size"):
                nbytes = tensor.numel() * tensor.element_size()
            self.collectives.append((name, src, nbytes))

        return record

    def install_syncs(self, targets: list[tuple[Any, str, str]]) -> list[str]:
        """Wrap each (owner, attribute, label) synchronize point; returns the
        labels wrapped."""
        wrapped = []
        for owner, name, label in targets:
            if self.wrap(owner, name, self._sync_recorder(label)):
                wrapped.append(label)
        return wrapped

    def _sync_recorder(self, label: str) -> Callable[..., None]:
        def record(*_args: Any, **_kwargs: Any) -> None:
            self.syncs[label] += 1

        return record

    def install_blocking_to(self, tensor_cls: Any, device_cls: Any) -> None:
        def record(*args: Any, **kwargs: Any) -> None:
            targets = list(args[1:]) + [kwargs.get("device")]
            to_device = any(isinstance(a, (str, device_cls)) for a in targets)
            non_blocking = bool(kwargs.get("non_blocking")) or any(a is True for a in args[1:])
            if to_device and not non_blocking:
                self.blocking_to += 1

        self.wrap(tensor_cls, "to", record)

    def install_engine(self, engine: Any, kv: Any) -> None:
        """LMCache's own calls: the connector's batched_to_gpu (once per
        rank, the connector is shared) and the sharded load's staging
        buffer."""
        def count_to_gpu(*_args: Any, **_kwargs: Any) -> None:
            self.to_gpu_calls += 1

        self.wrap(kv, "batched_to_gpu", count_to_gpu)
        allocate = getattr(engine, "_pcp_shard_staging_buffer", None)
        if allocate is None:
            return
        probe = self

        def staging_buffer(*args: Any, **kwargs: Any) -> Any:
            buffer = allocate(*args, **kwargs)
            if probe.armed == threading.get_ident():
                probe.staging_bytes.append(buffer.numel() * buffer.element_size())
            return buffer

        engine._pcp_shard_staging_buffer = staging_buffer


def sync_points(torch: Any, torch_dev: Any, streams: list[Any]) -> list[tuple[Any, str, str]]:
    """Every host synchronize point a load could reach, as (owner,
    attribute, label); those absent from this torch build are skipped."""
    points: list[tuple[Any, str, str]] = []
    for prefix, module in (("torch.cuda", torch.cuda), ("torch.cpu", torch.cpu),
                           ("torch.accelerator", getattr(torch, "accelerator", None)),
                           ("lmcache torch_dev", torch_dev)):
        if module is None:
            continue
        points.append((module, "synchronize", f"{prefix}.synchronize"))
        for cls_name in ("Stream", "Event"):
            cls = getattr(module, cls_name, None)
            if isinstance(cls, type):
                points.append((cls, "synchronize", f"{prefix}.{cls_name}.synchronize"))
    for stream in streams:
        cls = type(stream)
        points.append((cls, "synchronize", f"{cls.__module__}.{cls.__qualname__}.synchronize"))
    return points


# --------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------


def prompt_tokens(num_tokens: int) -> list[int]:
    return [(SEED + 13 * i) % 30011 for i in range(num_tokens)]


def build_engine(
    mode: str, rank: int, world_size: int, collectives: Any, kv: Any,
    layers: int, l1_gb: float, buffer_mb: float,
) -> Any:
    """An engine of ``mode`` on this rank, writing to the rank's stand-in
    paged KV cache ``kv`` (both engines share it, as one vLLM worker hands
    its KV cache to whichever engine it runs)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from tests.support.pcp_ranks import MODEL, ResponseRecorder, mla_metadata

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS,
        local_cpu=True,
        max_local_cpu_size=l1_gb,
        save_unfull_chunk=False,
        blocking_timeout_secs=5,
        extra_config={
            "pcp_shard_store": mode == "sharded",
            "save_chunk_meta": False,
            "first_rank_max_local_cpu_size": l1_gb,
            "pcp_shard_load_buffer_mb": buffer_mb,
        },
    )
    metadata = mla_metadata(
        MODEL, world_size, rank, pcp_world_size=world_size,
        num_layers=layers, head_size=HEAD, chunk_size=CHUNK_TOKENS,
    )
    engine = LMCacheEngineBuilder.get_or_create(
        f"load-bench-{mode}-{rank}", config, metadata, kv,
        collectives.broadcast, collectives.broadcast_object, pcp_collectives=collectives,
    )
    engine.post_init(async_lookup_server=ResponseRecorder())
    return engine


def fill_kv(kv: Any, num_tokens: int) -> None:
    """The KV every rank holds after the all-gather (the same on every
    rank), written one layer at a time so that no rank holds a float copy
    of the whole prompt."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    kv.kv.zero_()
    for layer in range(kv.kv.shape[1]):
        kv.kv[0, layer, :num_tokens] = torch.randn(num_tokens, HEAD, generator=gen).to(torch.bfloat16)


def kv_digest(kv: Any, num_tokens: int) -> str:
    """A digest of the first ``num_tokens`` tokens of every layer of the
    stand-in paged KV cache (one layer at a time: no copy of the whole)."""
    import torch

    digest = hashlib.blake2b(digest_size=16)
    for layer in range(kv.kv.shape[1]):
        rows = kv.kv[0, layer, :num_tokens].contiguous().view(torch.int16)
        digest.update(rows.numpy().tobytes())
    return digest.hexdigest()


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def rank_load(
    rank: int, world_size: int, workdir: str, num_tokens: int, layers: int,
    buffer_mb: float, l1_gb: float, repetitions: int,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lmcache import torch_dev
    from lmcache.v1.pcp_collectives import PCPCollectives
    from tests.support.pcp_ranks import make_kv_connector

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=900))
    ranks = list(range(world_size))
    cpu_group = dist.new_group(ranks, backend="gloo")
    collectives = PCPCollectives.from_process_groups(
        ranks, cpu_group, dist.new_group(ranks, backend="gloo"), torch.device("cpu"))
    kv = make_kv_connector(num_tokens, layers, HEAD, CHUNK_TOKENS)
    engines = {mode: build_engine(mode, rank, world_size, collectives, kv, layers, l1_gb, buffer_mb)
               for mode in MODES}
    tokens = prompt_tokens(num_tokens)
    stored_tokens = num_tokens // CHUNK_TOKENS * CHUNK_TOKENS  # save_unfull_chunk=False
    fill_kv(kv, num_tokens)
    reference = kv_digest(kv, stored_tokens)
    for engine in engines.values():
        engine.store(tokens)

    probe = Probe()
    probe.install_collectives(dist)
    streams = [e.broadcast_stream for e in engines.values() if getattr(e, "broadcast_stream", None) is not None]
    sync_labels = probe.install_syncs(sync_points(torch, torch_dev, streams))
    probe.install_blocking_to(torch.Tensor, torch.device)
    for engine in engines.values():
        probe.install_engine(engine, kv)

    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    records: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    loaded: dict[str, int] = {}
    verified: dict[str, bool] = {}
    for rep in range(repetitions):
        order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
        for mode in order:
            if rep == 0:
                kv.kv.zero_()
            dist.barrier(group=cpu_group)
            probe.arm()
            start = time.perf_counter()
            mask = engines[mode].retrieve(tokens)
            wall = time.perf_counter() - start
            records[mode].append(probe.disarm())
            walls[mode].append(wall)
            if rep == 0:
                loaded[mode] = int(mask.sum())
                verified[mode] = loaded[mode] == stored_tokens and kv_digest(kv, stored_tokens) == reference
            if rank == 0:
                progress(f"  W={world_size} {num_tokens:,} tokens: rep {rep + 1}/{repetitions} {mode:<7} "
                         f"{wall * 1e3:9.1f} ms on rank 0")
    dist.barrier(group=cpu_group)
    return {
        "rank": rank,
        "walls": walls,
        "records": records,
        "loaded_tokens": loaded,
        "stored_tokens": stored_tokens,
        "verified": verified,
        "sync_points": sync_labels,
        "device_type": str(getattr(torch_dev, "__name__", torch_dev)),
    }


# --------------------------------------------------------------------------
# Sizing and summary (parent process)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One prompt's run: its real chunk count, the layers it runs at and
    the staging buffer cap scaled with them."""

    tokens: int
    layers: int
    buffer_mb: float  # pcp_shard_load_buffer_mb at ``layers``: --buffer-mb x layers / 78
    layers_why: str  # why this layer count: fitted to the memory budget, or given

    @property
    def chunks(self) -> int:
        return self.tokens // CHUNK_TOKENS

    @property
    def chunk_bytes(self) -> int:
        return self.layers * CHUNK_TOKENS * ROW_BYTES

    @property
    def prompt_bytes(self) -> int:
        return self.chunks * self.chunk_bytes

    def l1_gb(self) -> float:
        """The pod's L1 budget: the stored prompt, with room for the
        allocator's rounding (the sharded store gives each rank 1/W)."""
        return (self.prompt_bytes * 1.1 + 8 * self.chunk_bytes) / 1024**3


def peak_bytes(prompt_bytes: int, world_size: int) -> float:
    """A bound on the run's memory: per rank the paged KV cache, the
    rank-0 path's L1 (rank 0) or receive buffers (the others), the sharded
    L1 share and its staging buffer."""
    return world_size * (2.0 * prompt_bytes + 2.2 * prompt_bytes / world_size)


def fit_layers(tokens: int, world_sizes: list[int], mem_gb: float) -> int:
    """The most layers (at most 78) whose run fits ``mem_gb`` at the largest W."""
    per_layer = tokens // CHUNK_TOKENS * CHUNK_TOKENS * ROW_BYTES
    budget = mem_gb * 1024**3
    layers = FULL_LAYERS
    while layers > 1 and peak_bytes(per_layer * layers, max(world_sizes)) > budget:
        layers -= 1
    return layers


def summarize(world_size: int, plan: Plan, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        first = per_rank[0]["records"][mode][0]
        logs = [r["records"][mode][0]["collectives"] for r in per_rank]
        counts = Counter(name for name, _src, _bytes in first["collectives"])
        stable = all(
            Counter(n for n, _s, _b in rec["collectives"]) == counts
            for r in per_rank for rec in r["records"][mode]
        )
        by_owner: Counter = Counter()
        for name, src, nbytes in first["collectives"]:
            if name == "broadcast" and nbytes is not None:
                by_owner[src] += nbytes
        staging = [b for r in per_rank for b in r["records"][mode][0]["staging_bytes"]]
        slowest = [max(r["walls"][mode][i] for r in per_rank) for i in range(len(per_rank[0]["walls"][mode]))]
        rows.append({
            "W": world_size,
            "tokens": plan.tokens,
            "mode": mode,
            "layers": plan.layers,
            "chunks": plan.chunks,
            "chunk_bytes": plan.chunk_bytes,
            "buffer_mb": plan.buffer_mb,
            "staging_capacity_bytes": min(staging) if staging else None,
            "loaded_tokens": per_rank[0]["loaded_tokens"][mode],
            "verified": all(r["verified"][mode] for r in per_rank),
            "same_collectives_on_every_rank": all(log == logs[0] for log in logs),
            "counts_stable_across_repetitions": stable,
            "collectives": dict(counts),
            "collectives_total": sum(counts.values()),
            "tensor_broadcasts": counts.get("broadcast", 0),
            "host_syncs": first["syncs"],
            "host_syncs_total": sum(first["syncs"].values()),
            "host_syncs_max_over_ranks": max(sum(r["records"][mode][0]["syncs"].values()) for r in per_rank),
            "batched_to_gpu_calls": first["to_gpu_calls"],
            "blocking_to_device_max_over_ranks": max(r["records"][mode][0]["blocking_to"] for r in per_rank),
            "bytes_by_owner": {str(k): v for k, v in sorted(by_owner.items())},
            "bytes_per_owner_max": max(by_owner.values()) if by_owner else 0,
            "slowest_retrieve_s": statistics.median(slowest),
            "slowest_retrieve_s_each": slowest,
        })
    base, sharded = rows
    sharded["ratio_collectives"] = base["collectives_total"] / max(1, sharded["collectives_total"])
    sharded["ratio_wall"] = base["slowest_retrieve_s"] / sharded["slowest_retrieve_s"]
    return rows


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def describe(plans: list[Plan], world_sizes: list[int], device_type: str) -> list[str]:
    lines = [
        "Load path under PCP: rank-0 retrieve vs PCP-sharded retrieve (LMCache patch 0010), "
        f"W = {', '.join(map(str, world_sizes))} ranks over gloo",
        f"geometry ({GEOMETRY_SOURCE}): {CHUNK_TOKENS}-token chunks of {FULL_CHUNK_BYTES:,} B "
        f"({geometry.GLM53.describe()} per token: MLA latent on every layer, DSA indexer on 21); the stand-in "
        f"gives each of the {FULL_LAYERS} layers {ROW_BYTES} B per token (their mean, rounded up to even)",
        f"device: none (LMCache's torch_dev is {device_type}): the paged KV cache, the staging buffer and "
        "L1 are CPU memory, 'host-to-device' copies are CPU copies, broadcasts go over gloo on loopback",
    ]
    full_per_piece = int(DEFAULT_BUFFER_MB * 1024**2) // FULL_CHUNK_BYTES
    for plan in plans:
        per_piece = int(plan.buffer_mb * 1024**2) // plan.chunk_bytes
        scaled = (f"layers SCALED DOWN to {plan.layers} of {FULL_LAYERS} {plan.layers_why}"
                  if plan.layers < FULL_LAYERS else f"all {FULL_LAYERS} layers")
        lines.append(
            f"{plan.tokens:,} tokens: {plan.chunks} full chunks (real count{unstored(plan)}), {scaled}: "
            f"chunk {plan.chunk_bytes / 1e6:.2f} MB, prompt {plan.prompt_bytes / 1e6:.0f} MB; staging cap "
            f"{plan.buffer_mb:.2f} MiB ({plan.buffer_mb * FULL_LAYERS / plan.layers:g} MiB at {FULL_LAYERS} layers)"
            + f": at most {per_piece} chunks per piece"
            + (f", as at {FULL_LAYERS} layers with LMCache's default" if per_piece == full_per_piece else "")
        )
    return lines


def unstored(plan: Plan) -> str:
    partial = plan.tokens - plan.chunks * CHUNK_TOKENS
    return f"; the last {partial} tokens are a partial chunk, not stored" if partial else ""


def table(rows: list[dict[str, Any]]) -> list[str]:
    header = (f"{'W':>2} {'tokens':>8}  {'mode':<7} {'chunks':>6} {'colls':>6} {'ag/bo/bc':>11} "
              f"{'syncs':>5} {'to_gpu':>6} {'blk.to':>6} {'owners':>6} {'MB/owner':>9} {'@78L MB':>8} "
              f"{'wall ms':>9} {'r0/sh colls':>11} {'r0/sh wall':>10}")
    lines = [header]
    for row in rows:
        c = row["collectives"]
        split = f"{c.get('all_gather_object', 0)}/{c.get('broadcast_object_list', 0)}/{c.get('broadcast', 0)}"
        other = row["collectives_total"] - sum(c.get(k, 0)
                                               for k in ("all_gather_object", "broadcast_object_list", "broadcast"))
        if other:
            split += f"+{other}"
        owner_mb = row["bytes_per_owner_max"] / 1e6
        ratios = ("", "")
        if row["mode"] == "sharded":
            ratios = (f"{row['ratio_collectives']:.1f}x", f"{row['ratio_wall']:.2f}x")
        lines.append(
            f"{row['W']:>2} {row['tokens']:>8,}  {row['mode']:<7} {row['chunks']:>6} {row['collectives_total']:>6} "
            f"{split:>11} {row['host_syncs_max_over_ranks']:>5} {row['batched_to_gpu_calls']:>6} "
            f"{row['blocking_to_device_max_over_ranks']:>6} {len(row['bytes_by_owner']):>6} {owner_mb:>9.1f} "
            f"{owner_mb * FULL_LAYERS / row['layers']:>8.0f} {row['slowest_retrieve_s'] * 1e3:>9.1f} "
            f"{ratios[0]:>11} {ratios[1]:>10}"
        )
    return lines


def legend(rows: list[dict[str, Any]], sync_labels: list[str]) -> list[str]:
    seen = sorted({label for row in rows for label in row["host_syncs"]})
    return [
        "colls: torch.distributed collectives one rank entered during retrieve (every rank the same); "
        "ag/bo/bc: all_gather_object / broadcast_object_list / tensor broadcast",
        f"syncs: host synchronize calls (most on any rank); hit: {', '.join(seen) or 'none'}; "
        f"watched: {len(sync_labels)} points (torch.cuda, torch.cpu, torch.accelerator, torch_dev, "
        "their Stream/Event classes, the engines' broadcast_stream)",
        "to_gpu: the connector's batched_to_gpu calls per rank. The CPU stand-in synchronizes nothing there; "
        "LMCache's CUDA connectors synchronize their load stream once per call, and the rank-0 path then "
        "skips its own broadcast_stream synchronize (it is the load stream)",
        "blk.to: blocking Tensor.to(device) calls (most on any rank): a copy the host waits for on a GPU, "
        "a no-op on CPU",
        "MB/owner: bytes the busiest owner broadcast, measured; @78L: the same at 78 layers; "
        "wall: median over repetitions of the slowest rank's retrieve (all ranks share this machine's cores)",
        "r0/sh: rank-0 path / sharded path",
    ]


def check(rows: list[dict[str, Any]]) -> list[str]:
    problems = []
    for row in rows:
        where = f"W={row['W']} {row['tokens']:,} tokens {row['mode']}"
        if not row["verified"]:
            problems.append(f"{where}: a rank's paged KV cache does not hold the stored prompt after retrieve "
                            f"(loaded {row['loaded_tokens']:,} tokens)")
        if not row["same_collectives_on_every_rank"]:
            problems.append(f"{where}: the ranks did not enter the same collectives")
        if not row["counts_stable_across_repetitions"]:
            problems.append(f"{where}: the collective counts differ between repetitions")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--prompts", default="16384,200000", help="prompt lengths in tokens (default 16k and 200k)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--layers", type=int, help=f"layers per chunk for every prompt (default: the most, up to "
                        f"{FULL_LAYERS}, that fit --mem-gb at the largest W)")
    parser.add_argument("--mem-gb", type=float, default=3.0,
                        help="KV memory the run may use, all ranks together (default 3; each rank "
                        "process needs ~0.5 GB more for torch and LMCache)")
    parser.add_argument("--buffer-mb", type=float, default=DEFAULT_BUFFER_MB,
                        help="pcp_shard_load_buffer_mb at 78 layers, scaled with the layers run (default 256)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per (W, prompt) run")
    parser.add_argument("--json", type=Path, help="write the rows as JSON (e.g. work/bench/pcp_load.json)")
    args = parser.parse_args(argv)

    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    plans = []
    for tokens in (int(t) for t in args.prompts.split(",")):
        if args.layers:
            layers, why = args.layers, "as given by --layers"
        else:
            layers = fit_layers(tokens, world_sizes, args.mem_gb)
            why = f"to fit --mem-gb {args.mem_gb:g} at W={max(world_sizes)}"
        plans.append(Plan(tokens, layers, args.buffer_mb * layers / FULL_LAYERS, why))
    # LMCache logs every retrieve at INFO; the table goes to stdout.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

    rows: list[dict[str, Any]] = []
    sync_labels: list[str] = []
    device_type = "?"
    started = time.perf_counter()
    for plan in plans:
        for world_size in world_sizes:
            progress(f"W={world_size}: {plan.tokens:,} tokens ({plan.chunks} chunks, {plan.layers} layers), "
                     f"{args.repetitions} repetitions ...")
            with tempfile.TemporaryDirectory(prefix=f"pcp-load-{world_size}-") as workdir:
                per_rank = run_processes(
                    world_size, rank_load, Path(workdir), timeout_s=args.timeout_s,
                    num_tokens=plan.tokens, layers=plan.layers, buffer_mb=plan.buffer_mb,
                    l1_gb=plan.l1_gb(), repetitions=args.repetitions,
                )
            sync_labels = per_rank[0]["sync_points"]
            device_type = per_rank[0]["device_type"]
            rows.extend(summarize(world_size, plan, per_rank))
    elapsed = time.perf_counter() - started

    print("\n".join(describe(plans, world_sizes, device_type)))
    print()
    print("\n".join(table(rows)))
    print()
    print("\n".join(legend(rows, sync_labels)))
    print(f"total run time {elapsed:.0f} s")
    problems = check(rows)
    for problem in problems:
        print(f"FAILED: {problem}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
