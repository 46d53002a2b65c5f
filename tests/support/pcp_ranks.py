"""Real PCP ranks on CPU: W processes, torch.distributed over gloo, LMCache's
real engine, storage manager, L1 and (optionally) a RESP L2 per rank.

What stands in for what, and why:

* ``CpuPagedKV`` stands in for vLLM's paged GPU KV cache and LMCache's GPU
  connector (there is no GPU here): each rank holds the whole prompt's MLA KV
  in a CPU tensor, as every PCP rank does after the all-gather, and the
  connector copies chunk slices between it and LMCache's memory objects.
* ``ResponseRecorder`` stands in for the async lookup server's ZMQ channel to
  the scheduler: it records the token count each rank's storage layer
  reports for a lookup id.
* With ``engine_options={"device_streams": True}``, CUDA's stream ordering
  (tests/support/device_streams.py): the cache engine's ``torch_dev`` orders
  work on streams as CUDA does, the PCP broadcast delivers on the caller's
  current stream, and the connector writes the paged KV on a load stream of
  its own, as LMCache's paged connectors (V2, V3) do.

Everything else is the real thing: process groups, the PCP collectives the
patch series adds, the cache engine, the storage manager, the L1 allocator,
Valkey servers and the native RESP client.

A scenario is a module-level function ``scenario(ctx: RankContext, **kw)``;
``run_ranks`` runs it on W spawned ranks and returns each rank's result. A
rank that does not finish within the timeout (a hang in a collective) fails
the run, and every rank is killed.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

MODEL = "pcp-test-model"
NUM_LAYERS = 3
HEAD_SIZE = 8
CHUNK_SIZE = 16


@dataclass
class RankContext:
    rank: int
    world_size: int
    engine: Any
    kv: Any  # make_kv_connector's CpuPagedKV: a class built inside that function, so not importable here
    responses: "ResponseRecorder"
    collectives: Any
    workdir: Path
    options: dict = field(default_factory=dict)
    streams: Any = None  # the DeviceStreams of a run with device_streams, else None


class ResponseRecorder:
    """Records what the storage layer reports to the scheduler per lookup id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self.responses: dict[str, int] = {}

    def send_response_to_scheduler(self, lookup_id: str, retrieved_length: int) -> None:
        with self._done:
            self.responses[lookup_id] = int(retrieved_length)
            self._done.notify_all()

    def wait(self, lookup_id: str, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        with self._done:
            while lookup_id not in self.responses:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no prefetch response for {lookup_id}")
                self._done.wait(left)
            return self.responses[lookup_id]


def _connector_base():
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

    return MockGPUConnector


def make_kv_connector(max_tokens: int, num_layers: int = NUM_LAYERS, head_size: int = HEAD_SIZE,
                      chunk_size: int = CHUNK_SIZE, streams: Any = None):
    """A CpuPagedKV instance (the class is built lazily so that importing this
    module does not import LMCache). With ``streams`` (a DeviceStreams) it
    writes the paged KV on a load stream of its own."""
    import torch

    base = _connector_base()

    class CpuPagedKV(base):  # type: ignore[misc, valid-type]
        """The prompt's MLA KV of one rank, [1, layers, tokens, head]."""

        def __init__(self) -> None:
            super().__init__(kv_shape=(num_layers, 1, chunk_size, 1, head_size))
            self.kv = torch.zeros(1, num_layers, max_tokens, head_size, dtype=torch.bfloat16)

        def fill(self, seed: int, num_tokens: int) -> None:
            """The KV every rank holds after the all-gather: a pure function
            of (seed, token position), the same on all ranks."""
            gen = torch.Generator().manual_seed(seed)
            data = torch.randn(1, num_layers, num_tokens, head_size, generator=gen)
            self.kv.zero_()
            self.kv[:, :, :num_tokens, :] = data.to(torch.bfloat16)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                obj.tensor.copy_(self.kv[:, :, start:end, :])

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.kv[:, :, start:end, :] = obj.tensor.reshape(1, num_layers, end - start, head_size)

    if streams is None:
        return CpuPagedKV()

    class CpuPagedKVOnLoadStream(CpuPagedKV):
        """Writes the paged KV as VLLMPagedMemGPUConnectorV2/V3's batched_to_gpu
        do: under ``stream(self.load_stream)``, then synchronizes that stream.
        The engine finds ``load_stream`` and makes it its broadcast stream."""

        def __init__(self) -> None:
            super().__init__()
            self.load_stream = streams.Stream()

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
            with streams.stream(self.load_stream):
                streams.launch(lambda: CpuPagedKV.batched_to_gpu(self, memory_objs, starts, ends, **kwargs))
            self.load_stream.synchronize()

    return CpuPagedKVOnLoadStream()


def valkey_engine_config(url: str):
    """A one-rank engine config with a small L1 and ``url`` (a real Valkey) as L2."""
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE,
        local_cpu=True,
        max_local_cpu_size=0.02,
        remote_url=url,
        remote_serde="naive",
        save_unfull_chunk=False,
        blocking_timeout_secs=5,
        extra_config={"save_chunk_meta": False, "resp_num_threads": 2},
    )


def guard_vllm_config(**parallel):
    """What VllmServiceFactory reads of a vLLM config, for the init guards' tests: vLLM's own
    ParallelConfig (which validates the sizes as vLLM does) and small stand-ins for the model and
    cache configs (the real ones need a model download), an MLA model of 3 layers."""
    from types import SimpleNamespace

    import torch
    from vllm.config import ParallelConfig

    model_config = SimpleNamespace(
        model="guards-model",
        served_model_name="guards-model",
        dtype=torch.bfloat16,
        use_mla=True,
        get_num_layers=lambda parallel_config: 3,
        get_num_kv_heads=lambda parallel_config: 1,
        get_head_size=lambda: 8,
    )
    return SimpleNamespace(
        parallel_config=ParallelConfig(**parallel),
        model_config=model_config,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        speculative_config=None,
        kv_transfer_config=None,
    )


def mla_metadata(
    model_name: str,
    world_size: int,
    rank: int,
    *,
    pcp_world_size: int | None = None,
    pcp_rank: int | None = None,
    use_mla: bool = True,
    num_layers: int = NUM_LAYERS,
    head_size: int = HEAD_SIZE,
    chunk_size: int = CHUNK_SIZE,
):
    """LMCacheMetadata of worker ``rank`` of ``world_size`` with an MLA-shaped
    KV cache. The PCP fields are set only when ``pcp_world_size`` is given
    and the build has them: a tree without the sharded store (pristine, or
    the series without 0009) has none, and sees the worker as upstream does,
    so a proof fails there on behaviour, not on a constructor argument."""
    import dataclasses

    import torch

    from lmcache.v1.metadata import LMCacheMetadata

    pcp = {}
    has_pcp = "pcp_world_size" in {f.name for f in dataclasses.fields(LMCacheMetadata)}
    if pcp_world_size is not None and has_pcp:
        pcp = {"pcp_world_size": pcp_world_size, "pcp_rank": rank if pcp_rank is None else pcp_rank}
    return LMCacheMetadata(
        model_name=model_name,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=rank,
        local_worker_id=rank,
        kv_dtype=torch.bfloat16,
        kv_shape=(num_layers, 1, chunk_size, 1, head_size),
        use_mla=use_mla,
        role="worker",
        chunk_size=chunk_size,
        **pcp,
    )


def build_engine(
    rank: int,
    world_size: int,
    collectives: Any,
    *,
    instance_id: str,
    shard: bool = True,
    async_loading: bool = False,
    remote_url: str | None = None,
    l1_gb: float = 0.05,
    first_rank_l1_gb: float | None = None,
    max_tokens: int = 4096,
    extra: dict | None = None,
    num_layers: int = NUM_LAYERS,
    head_size: int = HEAD_SIZE,
    chunk_size: int = CHUNK_SIZE,
    streams: Any = None,
):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    extra_config: dict = {"pcp_shard_store": shard, "save_chunk_meta": False}
    if first_rank_l1_gb is not None:
        extra_config["first_rank_max_local_cpu_size"] = first_rank_l1_gb
    if remote_url is not None:
        extra_config["resp_num_threads"] = 2
    extra_config.update(extra or {})
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_size,
        local_cpu=True,
        max_local_cpu_size=l1_gb,
        remote_url=remote_url,
        remote_serde="naive",
        save_unfull_chunk=False,
        enable_async_loading=async_loading,
        blocking_timeout_secs=5,
        extra_config=extra_config,
    )
    metadata = mla_metadata(
        MODEL,
        world_size,
        rank,
        pcp_world_size=world_size,
        num_layers=num_layers,
        head_size=head_size,
        chunk_size=chunk_size,
    )
    kv = make_kv_connector(max_tokens, num_layers, head_size, chunk_size, streams)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id,
        config,
        metadata,
        kv,
        collectives.broadcast,
        collectives.broadcast_object,
        pcp_collectives=collectives,
    )
    responses = ResponseRecorder()
    engine.post_init(async_lookup_server=responses)
    return engine, kv, responses


def record_collectives(collectives: Any) -> Any:
    """The same collectives, each call appended to ``.log`` as (operation,
    source rank, bytes) so tests can check that every rank issued the same
    collectives in the same order."""
    from dataclasses import replace

    log: list[tuple] = []

    def broadcast(tensor, src):
        log.append(("broadcast", src, tensor.numel() * tensor.element_size()))
        return collectives.broadcast(tensor, src)

    def broadcast_object(obj, src):
        log.append(("broadcast_object", src, None))
        return collectives.broadcast_object(obj, src)

    def all_gather_object(obj):
        log.append(("all_gather_object", None, None))
        return collectives.all_gather_object(obj)

    recorded = replace(
        collectives, broadcast=broadcast, broadcast_object=broadcast_object, all_gather_object=all_gather_object
    )
    object.__setattr__(recorded, "log", log)
    return recorded


def _process_main(
    rank: int,
    world_size: int,
    workdir: str,
    target: Callable[..., Any],
    kwargs: dict,
) -> None:
    """Run ``target(rank, world_size, workdir, **kwargs)`` and write its result
    (or traceback) where the parent reads it."""
    out = Path(workdir) / f"rank{rank}.pickle"
    try:
        payload: Any = ("ok", target(rank, world_size, workdir, **kwargs))
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = ("error", traceback.format_exc())
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(payload))
    tmp.rename(out)
    # Background threads (event loops, RESP clients) are not joined: the
    # process exits once its result is on disk.
    os._exit(0)


def _engine_rank(
    rank: int,
    world_size: int,
    workdir: str,
    scenario: Callable[..., Any],
    engine_options: dict,
    scenario_kwargs: dict,
    pg_timeout_s: float = 60.0,
) -> Any:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/rendezvous",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    from lmcache.v1.pcp_collectives import PCPCollectives

    ranks = list(range(world_size))
    cpu_group = dist.new_group(ranks, backend="gloo")
    device_group = dist.new_group(ranks, backend="gloo")
    collectives = record_collectives(
        PCPCollectives.from_process_groups(ranks, cpu_group, device_group, torch.device("cpu"))
    )
    remote_urls = engine_options.pop("remote_urls", None)
    if remote_urls is not None:
        engine_options["remote_url"] = remote_urls[rank]
    streams = None
    if engine_options.pop("device_streams", False):
        import lmcache.v1.cache_engine as cache_engine

        from tests.support.device_streams import DeviceStreams

        # The rank is a process of its own: the engine keeps this device to the end.
        streams = DeviceStreams(cache_engine.torch_dev)
        cache_engine.torch_dev = streams
        collectives = streams.ordered_broadcasts(collectives)
    engine, kv, responses = build_engine(
        rank,
        world_size,
        collectives,
        instance_id=f"pcp-rank-{rank}",
        streams=streams,
        **engine_options,
    )
    ctx = RankContext(rank, world_size, engine, kv, responses, collectives, Path(workdir), streams=streams)
    result = scenario(ctx, **scenario_kwargs)
    dist.barrier(group=cpu_group)
    return result


_FORKSERVER = None


def _context():
    """Ranks fork from a server process that imported torch and LMCache once
    (spawning each rank from scratch costs ~10 s of imports per rank on two
    cores). The server is a clean single-threaded process, not pytest."""
    global _FORKSERVER
    import torch.multiprocessing as mp

    if _FORKSERVER is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_forkserver_preload())
        _FORKSERVER = ctx
    return _FORKSERVER


def _forkserver_preload() -> list[str]:
    """torch always; LMCache (and vLLM's hash functions, which its token database imports when
    vLLM is installed: ~7-13 s here) only where there is no CUDA device. LMCache picks its
    device when imported, which initialises CUDA where there is one, and a process forked from
    one that has initialised CUDA cannot use it ("Cannot re-initialize CUDA in forked
    subprocess"): there each rank imports LMCache itself."""
    import torch

    modules = ["torch", "torch.distributed"]
    if not torch.cuda.is_available():
        modules += ["vllm.v1.core.kv_cache_utils", "lmcache.v1.cache_engine", "tests.lmcache.pcp_scenarios"]
    return modules


def run_ranks(
    world_size: int,
    scenario: Callable[..., Any],
    workdir: Path,
    *,
    timeout_s: float = 180.0,
    engine_options: dict | None = None,
    pg_timeout_s: float = 60.0,
    **scenario_kwargs: Any,
) -> list[Any]:
    """Run ``scenario`` on ``world_size`` real ranks, each with a sharded
    engine on a real PCP group; return their results (see run_processes).
    ``pg_timeout_s`` is the process groups' timeout: a collective that a
    peer never enters raises after it."""
    return run_processes(
        world_size,
        _engine_rank,
        workdir,
        timeout_s=timeout_s,
        scenario=scenario,
        engine_options=dict(engine_options or {}),
        scenario_kwargs=scenario_kwargs,
        pg_timeout_s=pg_timeout_s,
    )


def run_processes(
    world_size: int,
    target: Callable[..., Any],
    workdir: Path,
    *,
    timeout_s: float = 180.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``target(rank, world_size, workdir, **kwargs)`` in ``world_size``
    processes; return their results.

    The processes fork from one server process, so they share its hash seed
    (LMCache's builtin chunk hash needs one seed across ranks, as
    PYTHONHASHSEED gives in production).

    Raises AssertionError naming the ranks that raised or did not finish in
    ``timeout_s`` (a hang in a collective)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = _context()
    procs = [
        ctx.Process(
            target=_process_main,
            args=(rank, world_size, str(workdir), target, kwargs),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    if hung:
        raise AssertionError(f"W={world_size}: ranks {hung} did not finish within {timeout_s:.0f} s (hang)")
    results: list[Any] = []
    errors: list[str] = []
    for rank in range(world_size):
        path = workdir / f"rank{rank}.pickle"
        if not path.exists():
            errors.append(f"rank {rank}: exited with {procs[rank].exitcode} and no result")
            continue
        status, value = pickle.loads(path.read_bytes())
        if status != "ok":
            errors.append(f"rank {rank} raised:\n{value}")
        results.append(value)
    if errors:
        raise AssertionError(f"W={world_size}:\n" + "\n".join(errors))
    return results
