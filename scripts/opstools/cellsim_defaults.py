"""cellsim's defaults, each from the write-up's measurements, in the units they were measured in.

The write-up measured with 12.4 MB chunks (``WRITEUP_CHUNK_BYTES``); a time
per GET applied to another chunk size is scaled by bytes (the server's time per
GET is assumed to follow the bytes it moves). Each default below names its
measurement; they build on each other in this order.

- ``GET_MS`` 8.9 ms: Valkey's server time per 12.4 MB GET with eight shards,
  one rank's loads per shard (run H5b): a GET with one client in flight.
- ``GPU_LOAD_S_PER_CHUNK`` 1.05 ms: GPU work per loaded chunk, inside the
  step, for every request the step carries. The sharded store's load is "one
  broadcast per chunk from its owner", a collective the GPUs run for each
  chunk, and the sync runaway's "GPUs only 7% busy" counts it. Over that run
  (374 s of sends plus its 83.7 s p99) 7% is 71 ms of GPU per request, of
  which computing the 256 tokens not in L2 takes 4.8 ms (16k tokens per
  0.31 s): 66 ms over the 63 loaded chunks. The runaway's steps batch several
  requests, so this work has to come with each request (its chunks), not with
  each step: 66 ms per step gives 1.8% busy, not 7%.
- ``GPU_STEP_S`` 0: GPU work per step besides recompute and the loaded chunks'.
  No measurement separates it from the per-chunk work above, which the 7%
  needs whole.
- ``ENGINE_LOAD_S_PER_CHUNK`` 4.2 ms: with eight shards the median 16k hit
  took about 0.1 s over the 0.31 s recompute, "spent in the engine, in the
  per-chunk broadcast and load path". Of those 0.41 s the GETs take 71 ms
  (8 x 8.9 ms per shard), the broadcasts' GPU work 63 x 1.05 ms and the
  256 uncomputed tokens 4.8 ms; the rest, over the 63 chunks loaded, is the
  engine's time per chunk (the exchange, Python, the copies to CPU buffers
  and into GPU memory).
- ``STEP_COPY_S_PER_CHUNK`` 1.0 ms: of that engine time, the part that moves
  a loaded chunk into GPU memory: its owner's copy from CPU before the
  chunk's broadcast, the other ranks waiting for it at the broadcast. Only a
  step can do it (the GPU blocks it fills are the ones the scheduler gave the
  request for that step), so async loading spends it in the step too. The
  write-up measured such an in-step copy, the other way, in its first
  bottleneck: rank 0 "wrote 19.1 GB of KV to CPU" while "Ranks 1-7
  accumulated about 1.55 s each of AllGather wait", 12.3 GB/s: 1.55 s x
  12.4 MB / 19.1 GB per chunk.
- ``ASYNC_LOAD_PATH`` "prefetch": with async loading the rest of the engine
  time (3.2 ms per chunk: Python, the copies to CPU buffers) is spent by the
  request's own background prefetch, as the write-up's setup runs it: "Each
  rank prefetches in the background" through a native client with
  ``resp_num_threads`` 32, and "a slow load delays only its own request,
  while the engine keeps running others"; the step holds the pod only for
  the copies and the GPU work, which is how the write-up reads its eight
  shards (rho ~ 0.09, "async loading has no backlog to absorb"). With
  "loader" the pod's one background loader spends it, the prefetches in
  turn, outside the step; with "step" the step spends all of it, holding the
  pod (the pessimistic end). Synchronous loading spends all of it in the
  step.
- ``GET_CONTENTION`` 0.5%: one instance loaded a 16k prompt (64 chunks, all
  eight ranks reading it) in 0.83-0.89 s. At the midpoint 0.86 s that is
  13.4 ms per chunk; less the engine's 4.2 ms, 9.2 ms per GET with eight
  clients in flight against 8.9 ms with one: each further client adds 0.5% to
  a GET. Across the measured 0.83-0.89 s the same arithmetic gives 0-1.2%.
- ``STEP_TOKENS`` 131,072: the prefill preset's ``max-num-batched-tokens``;
  ``STEP_REQUESTS`` 1,024: vLLM's ``max_num_seqs`` on a GPU of 70 GiB or more.
- ``ASYNC_TIMEOUT_S`` 3 s: the write-up's async lookup timeout. Timed-out
  prefetches "kept running in the background": no cap by default.
"""
from __future__ import annotations

from kvsizing.geometry import CHUNK_BYTES, WRITEUP_CHUNK_BYTES

CHUNK_TOKENS = 256
RECOMPUTE_TOKENS = 16_384
RECOMPUTE_S = 0.31  # cold replay: a 16k prompt prefilled from scratch
PREFILL_TOKENS_PER_S = RECOMPUTE_TOKENS / RECOMPUTE_S

GET_MS = 8.9  # H5b, per 12.4 MB GET, one rank per shard
RANKS = 8
INSTANCE_LOAD_S = (0.83, 0.86, 0.89)  # one instance, a 16k prompt's 64 chunks: low, midpoint, high as measured
LOAD_CHUNKS = 64
HIT_CHUNKS = 63  # 98.5% of a 16k prompt in L2

# the sync runaway: 7% GPU busy over 374 s of sends plus the 83.7 s p99, 450 requests, each with its chunks' GPU work
_SYNC_RUN_GPU_S_PER_REQUEST = 0.07 * (374.0 + 83.7) / 450
_UNCACHED_S = (RECOMPUTE_TOKENS - HIT_CHUNKS * CHUNK_TOKENS) / PREFILL_TOKENS_PER_S
GPU_LOAD_S_PER_CHUNK = (_SYNC_RUN_GPU_S_PER_REQUEST - _UNCACHED_S) / HIT_CHUNKS
GPU_STEP_S = 0.0
ASYNC_LOAD_PATH = "prefetch"

# eight shards: the median 16k hit ~0.1 s over recompute; what the GETs and the step do not take is the engine's
_HIT_GETS_S = 8 * GET_MS / 1000
ENGINE_LOAD_S_PER_CHUNK = ((RECOMPUTE_S + 0.1 - _HIT_GETS_S - HIT_CHUNKS * GPU_LOAD_S_PER_CHUNK - _UNCACHED_S)
                           / HIT_CHUNKS)


def contention_from_load(load_s: float, chunks: int, engine_s_per_chunk: float, one_client_get_s: float,
                         clients: int) -> float:
    """The extra share of a GET per further client in flight, from one load of ``chunks`` chunks that
    ``clients`` clients read from one instance in ``load_s`` (the engine's load path included)."""
    if clients < 2:
        return 0.0
    get_s = load_s / chunks - engine_s_per_chunk
    return max(0.0, (get_s / one_client_get_s - 1) / (clients - 1))


def writeup_contention(load_s: float) -> float:
    return contention_from_load(load_s, LOAD_CHUNKS, ENGINE_LOAD_S_PER_CHUNK, GET_MS / 1000, RANKS)


GET_CONTENTION = writeup_contention(INSTANCE_LOAD_S[1])

# the first bottleneck's capture: rank 0 copied 19.1 GB of KV to CPU inside the steps, the others waited 1.55 s for it
_STEP_COPY_BYTES = 19.1e9
_STEP_COPY_S = 1.55
STEP_COPY_S_PER_CHUNK = _STEP_COPY_S * WRITEUP_CHUNK_BYTES / _STEP_COPY_BYTES

STEP_TOKENS = 131_072
STEP_REQUESTS = 1_024
ASYNC_TIMEOUT_S = 3.0


def get_s_for_chunk(get_ms: float, measured_chunk_bytes: float, chunk_bytes: float) -> float:
    """Seconds per GET of ``chunk_bytes``, from ``get_ms`` measured with ``measured_chunk_bytes`` chunks."""
    return get_ms / 1000 * chunk_bytes / measured_chunk_bytes


def get_s_from_gbps(gbps: float, chunk_bytes: float) -> float:
    """Seconds per GET of ``chunk_bytes`` at ``gbps`` (a bandwidth is already per byte)."""
    return chunk_bytes / (gbps * 1e9)


# the default cell reads GLM-5.3's own chunk (12.2 MB), the time per GET scaled by bytes
DEFAULT_GET_S = get_s_for_chunk(GET_MS, WRITEUP_CHUNK_BYTES, CHUNK_BYTES)
