"""GLM-5's vLLM KV cache through LMCache's real vLLM adapter, on CPU.

One process is one vLLM worker (world size 1, gloo): vLLM's own
``LMCacheConnectorV1`` is built with the real ``VllmConfig`` and
``KVCacheConfig`` (see glm5_vllm_kv.py), which builds LMCache's adapter,
service factory, metadata, ``CreateGPUConnector`` choice and engine; then the
worker's ``register_kv_caches`` hands it the ``kv_caches`` dict, and a prompt
is stored and loaded the way ``wait_for_save`` / ``start_load_kv`` call the
engine (``kvcaches=list(kv_caches.values())``, the request's slot mapping).

Without CUDA four things stand in, each only where LMCache asks for CUDA
before it reaches its torch fallback copy ops (``device_ops`` resolves to
``CpuDeviceOps`` here, whose ``multi_layer_kv_transfer`` is LMCache's own
vectorised torch implementation of the CUDA kernel):

- ``CreateGPUConnector`` dispatches on ``torch_device_type``; it is "cpu"
  here, for which LMCache has no vLLM connector. The stand-in compares equal
  to "cuda", so the CUDA branch (V2 / V3 paged connectors) is taken, and
  formats as "cpu", so the device that branch builds for the connector and
  its staging buffer is the CPU, where vLLM's tensors are.
- ``torch.cuda.Stream`` / ``torch.cuda.stream``: a stream whose work is
  synchronous, which is what the CPU copies are.
- The paged connectors' ``device.type == "cuda"`` assertions: compiled out of
  the connector methods that carry one (nothing else in them changes; see
  ``_without_cuda_asserts``).
- The device V3 is built for: ``CreateGPUConnector`` names it
  ``cuda:<local rank>``; a CPU tensor's device has no index ("cpu"), so V3
  (which checks that the registered caches are on its device) is given
  ``torch.device("cpu")``, the device vLLM's tensors are on.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import inspect
import os
import textwrap
from pathlib import Path
from typing import Any

CHUNK_SIZE = 256


class _CudaBranchOnCpu(str):
    def __format__(self, spec: str) -> str:
        return "cpu"


class _SyncStream:
    """torch.cuda.Stream for CPU copies, which complete before they return."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


def _without_cuda_asserts(cls: type, method: str) -> None:
    """Recompile ``cls.method`` from its source without the statements
    ``assert <...>.type == "cuda"``; raise if there is none to remove."""
    func = getattr(cls, method)
    source = textwrap.dedent(inspect.getsource(func))
    tree = ast.parse(source)

    class Strip(ast.NodeTransformer):
        removed = 0

        def visit_Assert(self, node: ast.Assert):
            if '"cuda"' in ast.unparse(node.test) or "'cuda'" in ast.unparse(node.test):
                Strip.removed += 1
                return ast.Pass()
            return node

    tree = Strip().visit(tree)
    ast.increment_lineno(tree, func.__code__.co_firstlineno - 1)
    if Strip.removed == 0:
        raise AssertionError(f"{cls.__name__}.{method} has no CUDA assertion to remove")
    ast.fix_missing_locations(tree)
    namespace: dict[str, Any] = {}
    module = inspect.getmodule(func)
    exec(compile(tree, inspect.getsourcefile(func) or "<lmcache>", "exec"), vars(module), namespace)
    setattr(cls, method, namespace[method])


def install_cpu_stand_ins() -> None:
    import torch

    import lmcache.v1.gpu_connector as gpu_connector
    from lmcache.v1.gpu_connector import gpu_connectors

    gpu_connector.torch_device_type = _CudaBranchOnCpu("cuda")
    torch.cuda.Stream = _SyncStream  # type: ignore[misc, assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    _without_cuda_asserts(gpu_connectors.VLLMPagedMemGPUConnectorV2, "_initialize_pointers")
    v3 = gpu_connectors.VLLMPagedMemGPUConnectorV3
    _without_cuda_asserts(v3, "__init__")
    build_v3 = v3.from_metadata.__func__

    def from_metadata(cls, metadata, use_gpu=False, device=None, layout_hints=None):
        assert device is not None and device.type == "cpu", device
        return build_v3(cls, metadata, use_gpu, torch.device("cpu"), layout_hints=layout_hints)

    v3.from_metadata = classmethod(from_metadata)


def start_worker(
    workdir: Path,
    variant: str,
    lmcache_env: dict[str, str] | None = None,
    model_dir: Path | None = None,
    num_layers: int | None = None,
    device: str = "cpu",
    mtp_layers: int = 0,
):
    """vLLM's distributed state for one worker, the KV caches (on ``device``:
    on "cuda" nothing stands in, LMCache's CUDA kernels copy; ``num_layers``
    decoder layers, glm5_vllm_kv.NUM_LAYERS by default, and ``mtp_layers``
    MTP layers), and vLLM's LMCacheConnectorV1 (worker role) with LMCache's
    adapter inside."""
    env = {
        "LMCACHE_CHUNK_SIZE": str(CHUNK_SIZE),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.2",
        "LMCACHE_SAVE_UNFULL_CHUNK": "True",
        "LMCACHE_USE_LAYERWISE": "False",
        **(lmcache_env or {}),
    }
    os.environ.update(env)

    from vllm.config import KVTransferConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
        LMCacheConnectorV1,
    )

    from tests.lmcache.glm5_vllm_kv import NUM_LAYERS, build_glm5_kv_caches

    if device == "cpu":
        install_cpu_stand_ins()
    kv = build_glm5_kv_caches(
        model_dir or workdir / "model", variant, num_hidden_layers=num_layers or NUM_LAYERS, device=device,
        mtp_layers=mtp_layers,
    )
    kv.vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="LMCacheConnectorV1", kv_role="kv_both"
    )
    parallel_state.init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"file://{workdir}/vllm-rendezvous",
        local_rank=0,
        backend="gloo" if device == "cpu" else "nccl",
    )
    with set_current_vllm_config(kv.vllm_config):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        connector = LMCacheConnectorV1(kv.vllm_config, KVConnectorRole.WORKER, kv.kv_cache_config)
    return kv, connector


def _error(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


def fill_random(kv_caches: dict[str, Any], seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    for tensor in kv_caches.values():
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=generator))


def token_rows(tensor: Any, slots: Any) -> Any:
    """The rows (all bytes of each token) of ``slots`` in a [NB, 1, BS, W] view."""
    return tensor.reshape(-1, tensor.shape[-1])[slots]


def register_store_load(
    rank: int,
    world_size: int,
    workdir: str,
    variant: str,
    num_tokens: int,
    block_ids: list[int],
) -> dict[str, Any]:
    """Register vLLM's dict, store a prompt of ``num_tokens`` at ``block_ids``,
    clear the cache, load it back; report each step's outcome and, per layer,
    whether every byte of every prompt token came back."""
    import torch

    kv, connector = start_worker(Path(workdir), variant)
    result: dict[str, Any] = {
        "layers": {name: kv.role(name) for name in kv.kv_caches},
        "row_bytes": {name: int(t.shape[-1]) for name, t in kv.kv_caches.items()},
    }
    adapter = connector._lmcache_engine
    engine = adapter.lmcache_engine
    result["gpu_connector"] = type(engine.gpu_connector).__name__
    result["kv_shape"] = list(engine.metadata.kv_shape)
    try:
        connector.register_kv_caches(kv.kv_caches)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["register_error"] = _error(exc)
        return result
    fill_random(kv.kv_caches, seed=7)
    original = {name: t.clone() for name, t in kv.kv_caches.items()}
    slots = torch.cat([b * 64 + torch.arange(64) for b in block_ids])[:num_tokens]
    tokens = torch.arange(1000, 1000 + num_tokens)
    kvcaches = list(adapter.kv_caches.values())  # as wait_for_save passes them
    try:
        engine.store(tokens, kvcaches=kvcaches, slot_mapping=slots)
    except Exception as exc:  # noqa: BLE001
        result["store_error"] = _error(exc)
        return result
    for tensor in kv.kv_caches.values():
        tensor.zero_()
    try:
        mask = engine.retrieve(tokens, kvcaches=kvcaches, slot_mapping=slots)
    except Exception as exc:  # noqa: BLE001
        result["load_error"] = _error(exc)
        return result
    result["loaded"] = int(mask.sum())
    result["equal"] = {
        name: bool(torch.equal(token_rows(t, slots), token_rows(original[name], slots)))
        for name, t in kv.kv_caches.items()
    }
    return result


# --- The round trip of issue 15: every byte of both kinds of layer. ---------

INDEXER_VALUES = 128  # fp8 e4m3 values per token; then one fp32 scale


def token_bytes(tensor: Any, role: str, slots: Any) -> Any:
    """All bytes vLLM keeps for each token of ``slots`` in one layer, one row
    per token: a latent layer's row, or an indexer token's 128 fp8 values
    followed by its 4-byte scale, read through the blocked page layout (per
    block all tokens' values, then all their scales)."""
    import torch

    if role != "indexer":
        return tensor.reshape(-1, tensor.shape[-1])[slots]
    block_size = tensor.shape[-2]
    pages = tensor.reshape(tensor.shape[0], -1)
    values = pages[:, : block_size * INDEXER_VALUES].reshape(-1, block_size, INDEXER_VALUES)
    scales = pages[:, block_size * INDEXER_VALUES :].reshape(-1, block_size, 4)
    blocks, offsets = slots // block_size, slots % block_size
    return torch.cat([values[blocks, offsets], scales[blocks, offsets]], dim=1)


def fill_kv(kv: Any, seed: int) -> None:
    """Random bytes in every latent page; in every indexer page, each slot's
    128 fp8 values of a random key and a positive fp32 scale, written through
    the blocked layout (as vLLM's ``indexer_k_quant_and_cache`` does), so the
    indexer's scores on them are finite."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for name, tensor in kv.kv_caches.items():
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=generator))
        if kv.role(name) != "indexer":
            continue
        num_blocks, _, block_size, _ = tensor.shape
        keys = torch.randn(num_blocks, block_size, INDEXER_VALUES, generator=generator)
        scale = keys.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4) / 448.0
        fp8 = (keys / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        pages = tensor.view(num_blocks, -1)
        pages[:, : block_size * INDEXER_VALUES] = fp8.reshape(num_blocks, -1)
        pages[:, block_size * INDEXER_VALUES :] = scale.to(torch.float32).view(torch.uint8).reshape(num_blocks, -1)


def indexer_topk(rows: Any, query: Any, weights: Any, k: int) -> list[int]:
    """The DSA indexer's selection on cache bytes: each token's key is its
    fp8 e4m3 values times its fp32 scale; its score is sum_h w_h *
    relu(q_h . key); the top ``k`` token positions, best first."""
    import torch

    rows = rows.cpu()
    values = rows[:, :INDEXER_VALUES].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scale = rows[:, INDEXER_VALUES:].contiguous().view(torch.float32)
    keys = values * scale
    scores = (torch.relu(query @ keys.T) * weights[:, None]).sum(dim=0)
    return torch.topk(scores, min(k, scores.numel())).indices.tolist()


def slots_of(block_ids: list[int], num_tokens: int, block_size: int = 64) -> Any:
    import torch

    return torch.cat([b * block_size + torch.arange(block_size) for b in block_ids])[:num_tokens]


def round_trip(
    rank: int,
    world_size: int,
    workdir: str,
    variant: str,
    cases: list[dict[str, int]],
    store_blocks: list[int],
    load_blocks: list[int],
    phase: str = "both",
    lmcache_env: dict[str, str] | None = None,
    model_dir: str | None = None,
    num_layers: int | None = None,
    device: str = "cpu",
    async_loading: bool = False,
    mtp_layers: int = 0,
    group0_layer_count: bool = False,
) -> dict[str, Any]:
    """Register vLLM's dict through the adapter; then, for each case (a
    prompt of ``num_tokens`` tokens, the first ``vllm_cached_tokens`` of which
    vLLM already holds at the load), store it at ``store_blocks`` (``phase``
    "store" or "both") and (``phase`` "load", in a fresh process, or "both",
    after clearing the cache) load it into ``load_blocks``, as
    ``wait_for_save`` and ``start_load_kv`` call the engine. Reports, per
    case and layer, whether every byte of every loaded token equals the
    stored one, whether vLLM's cached tokens were left alone, and the DSA
    indexer's top-k on both caches.

    With ``async_loading`` (``enable_async_loading``, as the prefill preset
    runs) the adapter's LMCacheAsyncLookupServer prefetches (pin=True) what
    vLLM's scheduler-side connector asks for through its
    LMCacheAsyncLookupClient, the load takes the prefetched objects, and
    ``lookup_unpin`` (``wait_for_save``) ends the request; each case then
    also reports the (ref count, pin count) of every L1 chunk of its prompt
    after the prefetch and after the request.

    ``group0_layer_count`` is a negative control: LMCache's metadata then
    sizes every kernel group's part of a chunk by group 0's layer count (see
    :func:`size_every_group_as_group0`)."""
    env = {"LMCACHE_USE_GPU_CONNECTOR_V3": "True", **(lmcache_env or {})}
    if async_loading:
        env["LMCACHE_ENABLE_ASYNC_LOADING"] = "True"
    if group0_layer_count:
        size_every_group_as_group0()
    kv, connector = start_worker(
        Path(workdir), variant, env, Path(model_dir) if model_dir else None, num_layers, device, mtp_layers
    )
    adapter = connector._lmcache_engine
    engine = adapter.lmcache_engine
    result: dict[str, Any] = {"gpu_connector": type(engine.gpu_connector).__name__, "layout": kv.layout.name}
    try:
        connector.register_kv_caches(kv.kv_caches)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["register_error"] = _error(exc)
        return result
    lookup_client = _scheduler_lookup_client(kv) if async_loading else None
    if async_loading:
        result["lookup"] = [type(adapter.lookup_server).__name__, type(lookup_client).__name__]
    manager = engine.metadata.kv_layer_groups_manager
    result["groups"] = (
        [[str(g.engine_kv_format).split(".")[-1], g.num_layers, g.shape_desc.hs] for g in manager.kernel_groups]
        if manager is not None else None
    )
    result["cases"] = [
        _one_case(kv, adapter, engine, index, case, store_blocks, load_blocks, phase, lookup_client)
        for index, case in enumerate(cases)
    ]
    result["backends"] = list(engine.storage_manager.storage_backends)
    if phase == "store":
        # A store that raised submitted no puts: waiting for them would only run out the timeout.
        stored = all("store_error" not in case for case in result["cases"])
        result["remote_holds_all"] = stored and _wait_for_remote_puts(engine, cases)
    return result


def size_every_group_as_group0() -> None:
    """Break LMCache's per-group sizing on purpose: ``LMCacheMetadata.get_shapes``
    (the shapes of a chunk's memory object, one per kernel group: its kv
    size, layers, tokens and row width) gives every group group 0's layer
    count, as a sizing that ignored the groups' own layer counts would.
    With GLM-5's pattern the groups differ (indexer: 3 layers; latent: 8),
    so the round trip must see it."""
    import torch

    from lmcache.v1.metadata import LMCacheMetadata

    sized_per_group = LMCacheMetadata.get_shapes

    def get_shapes(self, num_tokens=None):
        shapes = sized_per_group(self, num_tokens)
        return [torch.Size([shape[0], shapes[0][1], *shape[2:]]) for shape in shapes]

    LMCacheMetadata.get_shapes = get_shapes


def _scheduler_lookup_client(kv: Any) -> Any:
    """The lookup client of vLLM's scheduler-side LMCacheConnectorV1 for the
    same engine (in vLLM it lives in the engine core process; here in the
    worker's process, talking to the worker's lookup server over ZMQ)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
        LMCacheConnectorV1,
    )

    with set_current_vllm_config(kv.vllm_config):
        scheduler = LMCacheConnectorV1(kv.vllm_config, KVConnectorRole.SCHEDULER, kv.kv_cache_config)
    return scheduler._lmcache_engine.lookup_client


def _async_lookup(client: Any, tokens: Any, lookup_id: str, timeout_s: float = 30.0) -> int:
    """What the scheduler does for a new request under async loading: send
    the lookup (every worker's server prefetches) and poll for the answer."""
    import time

    assert client.lookup_cache(lookup_id) == -1
    assert client.lookup(tokens, lookup_id=lookup_id) is None
    deadline = time.monotonic() + timeout_s
    while (answer := client.lookup_cache(lookup_id)) is None:
        assert time.monotonic() < deadline, f"no prefetch answer for {lookup_id}"
    return int(answer)


def prefetched_objects(engine: Any, lookup_id: str, timeout_s: float = 30.0) -> list[tuple[Any, Any]]:
    """The (key, memory object) pairs the prefetch of ``lookup_id`` holds,
    read from its event without taking it (the load takes it); [] if the
    prefetch registered none (it found nothing)."""
    import time

    from lmcache.v1.event_manager import EventStatus, EventType

    events = engine.event_manager
    deadline = time.monotonic() + timeout_s
    while (status := events.get_event_status(EventType.LOADING, lookup_id)) == EventStatus.ONGOING:
        assert time.monotonic() < deadline, f"the prefetch of {lookup_id} did not finish"
        time.sleep(0.01)
    if status != EventStatus.DONE:
        return []
    return [pair for tier in events.get_event_future(EventType.LOADING, lookup_id).result() for pair in tier]


def object_counts(engine: Any, tokens: Any, pairs: list[tuple[Any, Any]]) -> dict[int, list[Any]]:
    """Per prefetched chunk (by start): whether L1 holds that very object,
    its ref count and its pin count."""
    starts = {key: int(start) for start, _, key in engine.token_database.process_tokens(tokens)}
    backend = engine.storage_manager.local_cpu_backend
    return {
        starts[key]: [backend.hot_cache.get(key) is obj, obj.get_ref_count(), obj.meta.pin_count]
        for key, obj in pairs
    }


def l1_counts(engine: Any, tokens: Any) -> dict[int, list[int]]:
    """(ref count, pin count) of each chunk of ``tokens`` in L1, by start."""
    backend = engine.storage_manager.local_cpu_backend
    counts = {}
    for start, _, key in engine.token_database.process_tokens(tokens):
        obj = backend.hot_cache.get(key)
        if obj is not None:
            counts[int(start)] = [obj.get_ref_count(), obj.meta.pin_count]
    return counts


def _one_case(kv, adapter, engine, index, case, store_blocks, load_blocks, phase, lookup_client=None) -> dict[str, Any]:
    import torch

    num_tokens, vllm_cached_tokens = case["num_tokens"], case.get("vllm_cached_tokens", 0)
    result: dict[str, Any] = dict(case)
    tokens = torch.arange(num_tokens) + 1000 * (index + 1)  # no case hits another's chunks
    store_slots = slots_of(store_blocks, num_tokens)
    load_slots = slots_of(load_blocks, num_tokens)
    kvcaches = list(adapter.kv_caches.values())  # as wait_for_save passes them
    device = kvcaches[0].device  # the adapter hands the engine device slot mappings
    fill_kv(kv, seed=7 + index)
    original = {name: t.clone() for name, t in kv.kv_caches.items()}
    if phase in ("store", "both"):
        try:
            engine.store(tokens, kvcaches=kvcaches, slot_mapping=store_slots.to(device))
        except Exception as exc:  # noqa: BLE001
            result["store_error"] = _error(exc)
            return result
        result["stored_chunk_bytes"] = _stored_chunk_bytes(engine, tokens)
        if phase == "store":
            return result
    # What vLLM's pages hold before the load, its cached prefix included.
    before = {name: torch.full_like(t, 0xA5) for name, t in kv.kv_caches.items()}
    for name, tensor in kv.kv_caches.items():
        tensor.copy_(before[name])
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[: vllm_cached_tokens // CHUNK_SIZE * CHUNK_SIZE] = False
    load_kwargs: dict[str, Any] = {}
    scheduled = num_tokens
    if lookup_client is not None:
        lookup_id = f"glm5-async-{index}"
        scheduled = min(num_tokens, _async_lookup(lookup_client, tokens, lookup_id))
        result["lookup_answer"] = scheduled
        result["prefetched"] = l1_counts(engine, tokens)
        pairs = prefetched_objects(engine, lookup_id)
        result["prefetched_objects"] = object_counts(engine, tokens, pairs)
        load_kwargs["req_id"] = lookup_id
    try:
        ret = engine.retrieve(
            tokens[:scheduled], mask[:scheduled], kvcaches=kvcaches,
            slot_mapping=load_slots[:scheduled].to(device),
            vllm_cached_tokens=vllm_cached_tokens, **load_kwargs,
        )
    except Exception as exc:  # noqa: BLE001
        result["load_error"] = _error(exc)
        return result
    if lookup_client is not None:
        engine.lookup_unpin(load_kwargs["req_id"])  # wait_for_save
        result["after"] = l1_counts(engine, tokens)
        result["prefetched_objects_after"] = object_counts(engine, tokens, pairs)
    # The retrieved tokens are a prefix of the unmasked ones.
    end = int(ret.nonzero().max()) + 1 if int(ret.sum()) else 0
    result["loaded_end"] = end
    moved = torch.arange(vllm_cached_tokens, max(end, vllm_cached_tokens))
    kept = torch.arange(0, min(vllm_cached_tokens, num_tokens))
    result["equal"], result["mismatched_tokens"], result["cached_prefix_untouched"] = {}, {}, {}
    for name, tensor in kv.kv_caches.items():
        role = kv.role(name)
        got = token_bytes(tensor, role, load_slots[moved])
        want = token_bytes(original[name], role, store_slots[moved])
        result["equal"][name] = bool(torch.equal(got, want))
        result["mismatched_tokens"][name] = int((got != want).any(dim=1).sum())
        result["cached_prefix_untouched"][name] = bool(
            torch.equal(token_bytes(tensor, role, load_slots[kept]), token_bytes(before[name], role, load_slots[kept]))
        )
    result["topk"] = _topk_both(kv, original, store_slots, load_slots, moved)
    return result


def _topk_both(kv: Any, original: dict, store_slots: Any, load_slots: Any, moved: Any) -> dict[str, Any]:
    """Per indexer layer, the top-k over the loaded tokens on the original
    cache and on the restored one, and on a cache whose loaded tokens' indexer
    keys were left unset (zero: what a latent-only chunk leaves behind)."""
    import torch

    generator = torch.Generator().manual_seed(11)
    query = torch.randn(4, INDEXER_VALUES, generator=generator)
    weights = torch.rand(4, generator=generator)
    out: dict[str, Any] = {}
    for name, tensor in kv.kv_caches.items():
        if kv.role(name) != "indexer" or moved.numel() == 0:
            continue
        want = indexer_topk(token_bytes(original[name], "indexer", store_slots[moved]), query, weights, 64)
        got = indexer_topk(token_bytes(tensor, "indexer", load_slots[moved]), query, weights, 64)
        unset = torch.zeros(moved.numel(), INDEXER_VALUES + 4, dtype=torch.uint8)
        out[name] = {"original": want, "restored": got, "unset": indexer_topk(unset, query, weights, 64)}
    return out


def _stored_chunk_bytes(engine: Any, tokens: Any) -> list[int]:
    """The size of each chunk's memory object in the local CPU backend."""
    sizes = []
    backend = engine.storage_manager.local_cpu_backend
    for _, _, key in engine.token_database.process_tokens(tokens):
        obj = backend.hot_cache.get(key) if hasattr(backend, "hot_cache") else None
        if obj is not None:
            sizes.append(int(obj.get_size()))
    return sizes


def _wait_for_remote_puts(engine: Any, cases: list[dict[str, int]], timeout_s: float = 30.0) -> bool:
    """Wait until the remote backend holds every chunk of the cases'
    prompts the engine stores (its puts are asynchronous): the full ones, and
    the partial last one with ``save_unfull_chunk``; whether it does."""
    import time

    import torch

    remote = engine.storage_manager.storage_backends.get("RemoteBackend")
    if remote is None:
        return False
    keys = [
        key
        for index, case in enumerate(cases)
        for start, end, key in engine.token_database.process_tokens(
            torch.arange(case["num_tokens"]) + 1000 * (index + 1)
        )
        if end - start == CHUNK_SIZE or engine.config.save_unfull_chunk
    ]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(remote.contains(key) for key in keys):
            return True
        time.sleep(0.1)
    return False


def sharded_round_trip(
    rank: int,
    world_size: int,
    workdir: str,
    variant: str,
    num_tokens: int,
    store_blocks: list[int],
    load_blocks: list[int],
    num_blocks: int,
    async_loading: bool = False,
    vllm_cached_tokens: int = 0,
) -> dict[str, Any]:
    """One rank of a PCP group of ``world_size`` over gloo with the sharded
    store (``pcp_shard_store``): vLLM's GLM-5 dict on every rank (the whole
    prompt's KV, as after PCP's all-gather), registered with LMCache's V3
    connector and the roles LMCache's adapter reads from vLLM's specs; every
    rank stores (each keeps the chunks it owns), the cache is cleared, and
    every rank loads through the sharded load (owners broadcast their chunks,
    rebuilt from raw bytes and metadata) into other blocks, the first
    ``vllm_cached_tokens`` (whole chunks) masked as vLLM's own prefix.

    With ``async_loading`` each rank's engine answers prefetches through
    LMCache's real LMCacheAsyncLookupServer (pin=True) and rank 0 also runs
    the scheduler's real LMCacheAsyncLookupClient, which asks every rank's
    server over ZMQ and takes the minimum; every rank then loads what it
    prefetched and unpins (``wait_for_save``), and reports the (ref count,
    pin count) of its L1 chunks after the prefetch and after the request."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lmcache.integration.vllm.kv_cache_guard import kv_cache_roles
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV3
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.pcp_collectives import PCPCollectives

    from tests.lmcache.glm5_vllm_kv import LATENT_HEAD_SIZE, build_glm5_kv_caches
    from tests.support.pcp_ranks import ResponseRecorder

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    ranks = list(range(world_size))
    collectives = PCPCollectives.from_process_groups(
        ranks, dist.new_group(ranks, backend="gloo"), dist.new_group(ranks, backend="gloo"), torch.device("cpu")
    )
    install_cpu_stand_ins()
    kv = build_glm5_kv_caches(Path(workdir) / f"model-{rank}", variant, num_blocks=num_blocks)
    # kv_shape's layers, as vLLM's factory counts them: the decoder layers (one latent cache each).
    num_layers = sum(kv.role(name) != "indexer" for name in kv.kv_caches)
    metadata = LMCacheMetadata(
        model_name="glm5-pcp", world_size=world_size, local_world_size=world_size, worker_id=rank,
        local_worker_id=rank, kv_dtype=torch.uint8, kv_shape=(num_layers, 1, CHUNK_SIZE, 1, LATENT_HEAD_SIZE),
        use_mla=True, role="worker", chunk_size=CHUNK_SIZE, pcp_world_size=world_size, pcp_rank=rank,
    )
    roles = kv_cache_roles(kv.kv_caches, metadata, kv.kv_cache_config)
    connector = VLLMPagedMemGPUConnectorV3.from_metadata(
        metadata, False, torch.device("cpu"), layout_hints={"kv_cache_roles": roles}
    )
    kvcaches = list(kv.kv_caches.values())
    # As LMCache's adapter does at register_kv_caches (a tree without
    # 0015 has no eager registration: V3 then builds its groups at the
    # first transfer).
    register = getattr(connector, "register_kv_caches", None)
    if register is not None:
        register(kvcaches)
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE, local_cpu=True, max_local_cpu_size=0.2, save_unfull_chunk=False,
        blocking_timeout_secs=5, enable_async_loading=async_loading,
        extra_config={"pcp_shard_store": True, "save_chunk_meta": False},
    )
    if async_loading:
        # Names the ZMQ sockets: one name per run (its work directory).
        metadata.engine_id = "glm5-pcp-async-" + hashlib.blake2b(workdir.encode(), digest_size=6).hexdigest()
    engine = LMCacheEngineBuilder.get_or_create(
        f"glm5-pcp-{rank}", config, metadata, connector, collectives.broadcast, collectives.broadcast_object,
        pcp_collectives=collectives,
    )
    client = None
    if async_loading:
        from lmcache.v1.lookup_client.factory import LookupClientFactory

        server = LookupClientFactory.create_lookup_server(engine, metadata)
        engine.post_init(async_lookup_server=server)
        if rank == 0:
            client = LookupClientFactory.create_lookup_client(config, metadata)
    else:
        engine.post_init(async_lookup_server=ResponseRecorder())
    tokens = torch.arange(num_tokens) + 5000
    store_slots, load_slots = slots_of(store_blocks, num_tokens), slots_of(load_blocks, num_tokens)
    fill_kv(kv, seed=23)
    original = {name: t.clone() for name, t in kv.kv_caches.items()}
    engine.store(tokens, kvcaches=kvcaches, slot_mapping=store_slots)
    result: dict[str, Any] = {"owned_chunks": len(engine.storage_manager.local_cpu_backend.hot_cache)}
    result["owned_chunk_bytes"] = sorted(
        {int(o.get_size()) for o in engine.storage_manager.local_cpu_backend.hot_cache.values()}
    )
    # The sharded load's staging buffer for a one-chunk request: one chunk.
    result["staging_buffer_bytes"] = int(engine._pcp_shard_staging_buffer(1).numel())
    dist.barrier()
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[:vllm_cached_tokens] = False
    scheduled, load_kwargs = num_tokens, {}
    if async_loading:
        lookup_id = "glm5-pcp-async"
        answer = _async_lookup(client, tokens, lookup_id) if client is not None else None
        # The scheduler's decision reaches every worker in the connector metadata.
        scheduled = min(num_tokens, collectives.broadcast_object(answer, 0))
        result["lookup_answer"] = scheduled
        # Every server has answered, so every prefetch has finished.
        result["prefetched"] = l1_counts(engine, tokens)
        load_kwargs["req_id"] = lookup_id
    for tensor in kv.kv_caches.values():
        tensor.fill_(0xA5)
    ret = engine.retrieve(
        tokens[:scheduled], mask[:scheduled], kvcaches=kvcaches, slot_mapping=load_slots[:scheduled], **load_kwargs
    )
    if async_loading:
        engine.lookup_unpin(load_kwargs["req_id"])  # wait_for_save
        result["after"] = l1_counts(engine, tokens)
    end = int(ret.nonzero().max()) + 1 if int(ret.sum()) else 0
    result["loaded_end"] = end
    moved = torch.arange(vllm_cached_tokens, max(end, vllm_cached_tokens))
    result["mismatched_tokens"] = {
        name: int((token_bytes(t, kv.role(name), load_slots[moved])
                   != token_bytes(original[name], kv.role(name), store_slots[moved])).any(dim=1).sum())
        for name, t in kv.kv_caches.items()
    }
    result["topk"] = _topk_both(kv, original, store_slots, load_slots, moved)
    dist.barrier()
    return result


def detected_formats(rank: int, world_size: int, workdir: str, variant: str) -> dict[str, str]:
    """The format LMCache's detection gives each layer of vLLM's dict, with
    the layout hints of vLLM's layout plus each layer's role from its spec
    (MLA latent or DSA indexer)."""
    from lmcache.integration.vllm.utils import vllm_layout_hints
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.utils import normalize_and_discover_per_layer_formats

    from tests.lmcache.glm5_vllm_kv import build_glm5_kv_caches

    kv = build_glm5_kv_caches(Path(workdir) / "model", variant)
    hints = dict(vllm_layout_hints(kv.vllm_config) or {})
    hints["kv_cache_roles"] = ["indexer" if kv.role(name) == "indexer" else "mla" for name in kv.kv_caches]
    normalized, formats = normalize_and_discover_per_layer_formats(
        list(kv.kv_caches.values()), [], EngineType.VLLM, hints
    )
    return {
        name: f"{str(fmt).split('.')[-1]} {list(t.shape)}"
        for name, fmt, t in zip(kv.kv_caches, formats, normalized, strict=True)
    }


def chunk_sizes(
    rank: int,
    world_size: int,
    workdir: str,
    variant: str,
    num_layers: int,
    lmcache_env: dict[str, str],
) -> dict[str, Any]:
    """Register vLLM's dict of ``num_layers`` decoder layers with the V3
    connector and report the size of a full chunk as each consumer on the
    store and load path computes it: the engine's memory objects (from the
    metadata's shapes), the local CPU backend (``get_full_chunk_size_bytes``,
    and the chunk budget it gives), and the remote connector's full chunk
    and per-token sizes; with ``metadata.kv_shape`` for the record."""
    from lmcache.utils import get_size_bytes
    from lmcache.v1.memory_management import MemoryFormat

    env = {"LMCACHE_USE_GPU_CONNECTOR_V3": "True", **lmcache_env}
    kv, connector = start_worker(Path(workdir), variant, env, num_layers=num_layers)
    adapter = connector._lmcache_engine
    engine = adapter.lmcache_engine
    result: dict[str, Any] = {"kv_shape": list(engine.metadata.kv_shape)}
    try:
        connector.register_kv_caches(kv.kv_caches)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["register_error"] = _error(exc)
        return result
    metadata = engine.metadata
    local = engine.storage_manager.local_cpu_backend
    remote = engine.storage_manager.storage_backends["RemoteBackend"].connection
    remote = getattr(remote, "_connector", remote)  # inside InstrumentedRemoteConnector
    allocated = local.allocate(metadata.get_shapes(), metadata.get_dtypes(), MemoryFormat.KV_MLA_FMT)
    result.update(
        memory_object=int(allocated.get_size()),
        metadata_shapes=get_size_bytes(metadata.get_shapes(), metadata.get_dtypes()),
        local_cpu_full_chunk=int(local.get_full_chunk_size_bytes()),
        local_cpu_chunk_budget=int(local.calculate_chunk_budget()),
        local_cpu_bytes=int(local.config.max_local_cpu_size * 1024**3),
        allocator_align=int(local.memory_allocator.align_bytes),
        remote_full_chunk=int(remote.full_chunk_size_bytes),
        remote_token_bytes=int(remote.single_token_size),
    )
    allocated.ref_count_down()
    return result
