"""The cell a simulation runs: pods, ranks, Valkey instances, loading, and every mechanism's parameter.

Defaults are the write-up's measurements (``cellsim_defaults`` says which);
the model that runs them is ``cellsim_model``.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import cellsim_defaults as defaults

STORES = ("sharded", "rank0")
LOADINGS = ("sync", "async")
LOAD_PATHS = ("prefetch", "step", "loader")


@dataclass(frozen=True)
class CellConfig:
    pods: int = 1
    ranks: int = defaults.RANKS  # the PCP group that runs in lockstep (W)
    shards: int = 1  # Valkey instances (N)
    store: str = "sharded"
    loading: str = "sync"
    get_s: float = defaults.DEFAULT_GET_S  # one GET, one client in flight at the instance
    get_contention: float = defaults.GET_CONTENTION  # extra share of get_s per further client in flight
    engine_load_s_per_chunk: float = defaults.ENGINE_LOAD_S_PER_CHUNK
    step_copy_s_per_chunk: float = defaults.STEP_COPY_S_PER_CHUNK  # of the engine's time, what only the step can do
    gpu_step_s: float = defaults.GPU_STEP_S
    gpu_load_s_per_chunk: float = defaults.GPU_LOAD_S_PER_CHUNK
    async_load_path: str = defaults.ASYNC_LOAD_PATH
    step_tokens: int = defaults.STEP_TOKENS
    step_requests: int = defaults.STEP_REQUESTS
    chunk_tokens: int = defaults.CHUNK_TOKENS
    prefill_tokens_per_s: float = defaults.PREFILL_TOKENS_PER_S
    async_timeout_s: float = defaults.ASYNC_TIMEOUT_S
    orphan_cap: int | None = None  # None: every timed-out prefetch runs to its end
    lost_shards: tuple[int, ...] = ()  # instances that are down: lookups fail fast there, SETs are dropped
    store_new_chunks: bool = True

    def validate(self) -> None:
        if self.store not in STORES:
            raise ValueError(f"store {self.store!r}: expected one of {', '.join(STORES)}")
        if self.loading not in LOADINGS:
            raise ValueError(f"loading {self.loading!r}: expected one of {', '.join(LOADINGS)}")
        if self.async_load_path not in LOAD_PATHS:
            raise ValueError(f"async_load_path {self.async_load_path!r}: expected one of {', '.join(LOAD_PATHS)}")
        for name in ("pods", "ranks", "shards", "chunk_tokens", "step_tokens", "step_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("get_s", "prefill_tokens_per_s", "async_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("get_contention", "engine_load_s_per_chunk", "step_copy_s_per_chunk", "gpu_step_s",
                     "gpu_load_s_per_chunk"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.orphan_cap is not None and self.orphan_cap < 0:
            raise ValueError(f"orphan_cap must be >= 0, got {self.orphan_cap}")
        for shard in self.lost_shards:
            if not 0 <= shard < self.shards:
                raise ValueError(f"lost shard {shard}: the instances are 0..{self.shards - 1}")

    def shard_of(self, chunk: int) -> int:
        return 0 if self.store == "rank0" else (chunk % self.ranks) % self.shards

    def found_chunks(self, hit_chunks: int) -> int:
        """The prefix a lookup finds: it ends at the first chunk on a lost instance."""
        for chunk in range(hit_chunks):
            if self.shard_of(chunk) in self.lost_shards:
                return chunk
        return hit_chunks

    def streams(self, first_chunk: int, chunks: int) -> list[tuple[int, int, int]]:
        """(rank, instance, GETs) of each stream that moves chunks ``first_chunk .. first_chunk + chunks - 1``."""
        if chunks <= 0:
            return []
        if self.store == "rank0":
            return [] if 0 in self.lost_shards else [(0, 0, chunks)]
        per_rank = [0] * self.ranks
        for chunk in range(first_chunk, first_chunk + chunks):
            per_rank[chunk % self.ranks] += 1
        return [(rank, rank % self.shards, count) for rank, count in enumerate(per_rank)
                if count and rank % self.shards not in self.lost_shards]

    def chunks_per_shard(self, first_chunk: int, chunks: int) -> list[int]:
        """How many of the chunks each instance serves."""
        counts = [0] * self.shards
        for _, shard, gets in self.streams(first_chunk, chunks):
            counts[shard] += gets
        return counts

    def in_step_s_per_chunk(self) -> float:
        """Async loading: the engine's time per loaded chunk that its step spends (the copy into GPU memory, at
        most the whole engine time; all of it with ``async_load_path`` "step")."""
        if self.async_load_path == "step":
            return self.engine_load_s_per_chunk
        return min(self.step_copy_s_per_chunk, self.engine_load_s_per_chunk)

    def off_step_s_per_chunk(self) -> float:
        """Async loading: the rest of the engine's time per loaded chunk, spent by the prefetch or the loader."""
        return self.engine_load_s_per_chunk - self.in_step_s_per_chunk()

    def compute_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s
