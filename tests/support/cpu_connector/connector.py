"""A stand-in for LMCache's paged-memory GPU copy on vLLM's CPU MLA backend."""
from __future__ import annotations

import torch

from lmcache import device_ops
from lmcache.lmcache_native import EngineKVFormat, TransferDirection
from lmcache.logging import init_logger
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

logger = init_logger("dist_cpu_connector")

# vLLM's CPU MLA cache: per layer [num_blocks, block_size, head_size] (any
# extra unit dimension is squeezed); LMCache's name for that layout.
MLA_FORMAT = EngineKVFormat.NL_X_NB_BS_HS


class CPUMLAConnector(GPUConnectorInterface):
    """Copies MLA KV between vLLM's CPU paged cache and LMCache memory objects.

    It stands in for the GPU copy only (``VLLMPagedMemGPUConnectorV2`` under
    MLA: ``KV_MLA_FMT`` objects of shape [1, layers, tokens, head_size], the
    full-sequence slot mapping, the ``vllm_cached_tokens`` prefix skip); the
    copy itself is LMCache's own torch fallback
    (``device_ops.multi_layer_kv_transfer`` of the CPU device ops). Everything
    around it (LMCache's engine, L1, the RESP client, Valkey, vLLM's scheduler
    and connector API) is the real code.

    Its CUDA-stream behaviour is not the GPU's: every copy runs synchronously
    on the calling thread and is complete when the call returns, where the GPU
    connector copies on its own ``store_stream``/``load_stream`` and
    synchronizes them (and LMCache's broadcast under ``save_only_first_rank``
    rides ``load_stream``). Races between those streams and the compute stream
    cannot show here; tests of them need a GPU. MLA only: the non-MLA CPU
    layouts are not supported and raise.
    """

    def __init__(self, num_layers: int, head_size: int) -> None:
        self.num_layers = num_layers
        self.head_size = head_size
        self.kvcaches: list[torch.Tensor] | None = None
        self._layers: list[torch.Tensor] | None = None
        self._source: list[int] = []
        self.block_size = 0
        self.page_buffer_size = 0

    @classmethod
    def from_metadata(cls, config, metadata) -> "CPUMLAConnector":
        if not metadata.use_mla:
            raise RuntimeError("dist CPU connector: supports MLA models only (metadata.use_mla is False)")
        if config.use_layerwise or config.enable_blending:
            raise RuntimeError("dist CPU connector: use_layerwise and enable_blending are not supported")
        num_layers, kv_size, _, num_kv_heads, head_size = metadata.kv_shape
        if kv_size != 1 or num_kv_heads != 1:
            raise RuntimeError(f"dist CPU connector: expected an MLA kv_shape, got {metadata.kv_shape}")
        logger.info("dist CPU connector: stand-in for LMCache's GPU copy (MLA, %d layers, head size %d)",
                       num_layers, head_size)
        return cls(num_layers, head_size)

    def _paged_layers(self) -> list[torch.Tensor]:
        """Each layer as a [num_blocks * block_size, head_size] view of vLLM's cache."""
        assert self.kvcaches is not None, "kvcaches should be provided in kwargs or initialized beforehand"
        source = [t.data_ptr() for t in self.kvcaches]
        if self._layers is not None and source == self._source:
            return self._layers
        if len(self.kvcaches) != self.num_layers:
            raise RuntimeError(f"dist CPU connector: {len(self.kvcaches)} KV layers, metadata says {self.num_layers}")
        layers = []
        for tensor in self.kvcaches:
            if tensor.device.type != "cpu":
                raise RuntimeError(f"dist CPU connector: KV cache on {tensor.device}, expected cpu")
            shape = [d for d in tensor.shape[1:] if d != 1] if tensor.dim() > 3 else list(tensor.shape[1:])
            if tensor.dim() < 3 or len(shape) != 2 or shape[1] != self.head_size or not tensor.is_contiguous():
                raise RuntimeError(
                    f"dist CPU connector: expected a contiguous MLA layer [num_blocks, block_size, {self.head_size}]"
                    f" (unit dimensions allowed), got {tuple(tensor.shape)} stride {tensor.stride()}")
            self.block_size = shape[0]
            layers.append(tensor.view(-1, self.head_size))
        self.page_buffer_size = layers[0].shape[0]
        self._layers, self._source = layers, source
        return layers

    def _transfer(self, memory_obj: MemoryObj, start: int, end: int, direction, kwargs, skip: int = 0) -> None:
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' should be provided in kwargs.")
        layers = self._paged_layers()
        device_ops.multi_layer_kv_transfer(
            memory_obj.tensor, layers, kwargs["slot_mapping"][start:end], torch.device("cpu"),
            self.page_buffer_size, direction, MLA_FORMAT,
            block_size=self.block_size, head_size=self.head_size, skip_prefix_n_tokens=skip)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        assert memory_obj.tensor is not None
        self.initialize_kvcaches_ptr(**kwargs)
        if memory_obj.metadata.fmt != MemoryFormat.KV_MLA_FMT:
            raise ValueError("The memory object should be in KV_MLA_FMT format (dist CPU connector)")
        # As the GPU connector: never overwrite blocks vLLM itself already holds.
        vllm_cached = kwargs.get("vllm_cached_tokens", 0)
        skip = min(end - start, max(0, vllm_cached - start))
        self._transfer(memory_obj, start, end, TransferDirection.H2D, kwargs, skip)

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        assert memory_obj.tensor is not None
        self.initialize_kvcaches_ptr(**kwargs)
        self._transfer(memory_obj, start, end, TransferDirection.D2H, kwargs)
        memory_obj.metadata.fmt = MemoryFormat.KV_MLA_FMT

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([1, self.num_layers, num_tokens, self.head_size])
