"""GLM-5's vLLM KV cache through LMCache's real vLLM adapter, on CPU.

One process is one vLLM worker (world size 1, gloo): vLLM's own
``LMCacheConnectorV1`` is built with the real ``VllmConfig`` and
``KVCacheConfig`` (see glm5_vllm_kv.py), which builds LMCache's adapter,
service factory, metadata, ``CreateGPUConnector`` choice and engine; then the
worker's ``register_kv_caches`` hands it the ``kv_caches`` dict, and a prompt
is stored and loaded the way ``wait_for_save`` / ``start_load_kv`` call the
engine (``kvcaches=list(kv_caches.values())``, the request's slot mapping).

Without CUDA three things stand in, each only where LMCache asks for CUDA
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
"""

from __future__ import annotations

import ast
import contextlib
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


def start_worker(workdir: Path, variant: str, lmcache_env: dict[str, str] | None = None):
    """vLLM's distributed state for one worker, the KV caches, and vLLM's
    LMCacheConnectorV1 (worker role) with LMCache's adapter inside."""
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

    from tests.lmcache.glm5_vllm_kv import build_glm5_kv_caches

    install_cpu_stand_ins()
    kv = build_glm5_kv_caches(workdir / "model", variant)
    kv.vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="LMCacheConnectorV1", kv_role="kv_both"
    )
    parallel_state.init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"file://{workdir}/vllm-rendezvous",
        local_rank=0,
        backend="gloo",
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
