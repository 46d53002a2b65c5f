"""A discrete-event model (SimPy) of prefill pods loading KV from a Valkey tier.

What is modelled, and how:

- **Requests** arrive at their offsets (a generated Poisson stream or a
  replay stream) and go to the pods round-robin, as vLLM's P/D toy proxy
  routes them. Each has ``prompt_tokens`` and ``hit_tokens``: the prefix whose
  chunks are in L2 (whole chunks of ``chunk_tokens``).
- **Shards**: each Valkey instance is one single-threaded server (a SimPy
  ``Resource`` of capacity 1, first come first served) that spends
  ``get_s`` of server time per GET of one chunk, and as much per SET.
- **Which shard serves a chunk**: with the sharded store, chunk ``c`` belongs
  to rank ``c mod W`` and rank ``r`` reads instance ``r mod N`` (N = W: rank
  r of every pod reads shard r, shared by all pods); with the rank-0 store,
  rank 0 reads every chunk from shard 0. The GETs one prompt sends to one
  shard are held as one batch (``k * get_s``): under FIFO, batching the GETs
  issued at the same instant changes no batch's completion time.
- **Pods** run their PCP group in lockstep, so a pod is one server.
  *Synchronous* loading loads inside the engine step: the pod is frozen
  until every rank's GETs are done, then computes the tokens not loaded
  (``(prompt - hit) / prefill_tokens_per_s``). *Asynchronous* loading starts a
  prefetch on arrival and schedules the request when it completes, or after
  ``async_timeout_s``, whichever is first; on a timeout the whole prompt is
  recomputed while the prefetch keeps running (its GETs still occupy the
  shards). The pod computes one request at a time, first come first served.
- **Stores**: after its prefill a request SETs the chunks that were not in L2
  (in the background: the pod does not wait).
- **Time to first token** is the end of the request's prefill: the model is
  the cache tier and the prefill pods, with no decode, network, tokenizer or
  HTTP time, no lookup (EXISTS) cost and no L1 (CPU) hits.
- **GPU busy** is compute time over the pods' wall time: loading time, a
  frozen pod's or a prefetch's, is not GPU work.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import simpy
from kvsizing.geometry import CHUNK_BYTES

STORES = ("sharded", "rank0")
LOADINGS = ("sync", "async")


@dataclass(frozen=True)
class CellConfig:
    pods: int = 1
    ranks: int = 8  # the PCP group that runs in lockstep (W)
    shards: int = 1  # Valkey instances (N)
    store: str = "sharded"
    loading: str = "sync"
    # Server time per GET of GLM-5.3's 12.2 MB chunk at the write-up's midpoint 0.835 GB/s (measured with its
    # 12.4 MB chunks: 14.85 ms per GET there), the time scaled by bytes: 14.62 ms.
    get_s: float = CHUNK_BYTES / 0.835e9
    chunk_tokens: int = 256
    prefill_tokens_per_s: float = 16_384 / 0.31
    async_timeout_s: float = 3.0
    store_new_chunks: bool = True

    def validate(self) -> None:
        if self.store not in STORES:
            raise ValueError(f"store {self.store!r}: expected one of {', '.join(STORES)}")
        if self.loading not in LOADINGS:
            raise ValueError(f"loading {self.loading!r}: expected one of {', '.join(LOADINGS)}")
        for name in ("pods", "ranks", "shards", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("get_s", "prefill_tokens_per_s", "async_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def chunks_per_shard(self, first_chunk: int, chunks: int) -> list[int]:
        """How many of chunks ``first_chunk .. first_chunk + chunks - 1`` each shard serves."""
        counts = [0] * self.shards
        if self.store == "rank0":
            counts[0] = chunks
            return counts
        for chunk in range(first_chunk, first_chunk + chunks):
            counts[(chunk % self.ranks) % self.shards] += 1
        return counts


@dataclass(frozen=True)
class Arrival:
    arrival_s: float
    prompt_tokens: int
    hit_tokens: int  # whole chunks in L2 (0: a miss)


@dataclass
class Outcome:
    arrival: Arrival
    pod: int
    first_token_s: float | None = None
    timed_out: bool = False  # async: the lookup timeout fired and the prompt was recomputed
    load_s: float = 0.0  # time the request's L2 load took (sync: inside the step; async: the prefetch)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival.arrival_s


@dataclass
class SimResult:
    config: CellConfig
    outcomes: list[Outcome]
    shard_busy: list[list[tuple[float, float]]]  # per shard: (start, end) of each hold
    gpu_busy: list[list[tuple[float, float]]]  # per pod: (start, end) of each compute
    end_s: float  # the last first token or the end of the last transfer, whichever is later

    @property
    def makespan_s(self) -> float:
        return self.end_s

    def shard_utilisation(self) -> list[float]:
        span = self.end_s or 1.0
        return [sum(b - a for a, b in busy) / span for busy in self.shard_busy]

    def gpu_busy_fraction(self) -> float:
        span = self.end_s or 1.0
        return sum(b - a for busy in self.gpu_busy for a, b in busy) / (span * len(self.gpu_busy))

    def timeout_share(self) -> float:
        return sum(o.timed_out for o in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0


def poisson_arrivals(count: int, rate_per_s: float, prompt_tokens: int, hit_fraction: float, chunk_tokens: int,
                     seed: int, miss_share: float = 0.0) -> list[Arrival]:
    """``count`` Poisson arrivals; every request ``prompt_tokens`` long with the whole chunks of
    ``hit_fraction`` of it in L2, except a ``miss_share`` of them that find nothing."""
    rng = random.Random(seed)
    hit = math.floor(prompt_tokens * hit_fraction / chunk_tokens) * chunk_tokens
    arrivals = []
    now = 0.0
    for index in range(count):
        if index:
            now += rng.expovariate(rate_per_s)
        missed = miss_share > 0 and rng.random() < miss_share
        arrivals.append(Arrival(now, prompt_tokens, 0 if missed else hit))
    return arrivals


@dataclass
class _Cell:
    env: simpy.Environment
    config: CellConfig
    shards: list[simpy.Resource] = field(default_factory=list)
    shard_busy: list[list[tuple[float, float]]] = field(default_factory=list)
    gpu_busy: list[list[tuple[float, float]]] = field(default_factory=list)
    queues: list[simpy.Store] = field(default_factory=list)

    def _hold(self, shard: int, chunks: int):
        with self.shards[shard].request() as turn:
            yield turn
            start = self.env.now
            yield self.env.timeout(chunks * self.config.get_s)
            self.shard_busy[shard].append((start, self.env.now))

    def transfer(self, first_chunk: int, chunks: int) -> simpy.Event:
        """GETs (or SETs) of chunks ``first_chunk..first_chunk+chunks-1``; the event fires when all are done."""
        counts = self.config.chunks_per_shard(first_chunk, chunks)
        holds = [self.env.process(self._hold(s, k)) for s, k in enumerate(counts) if k]
        return self.env.all_of(holds)

    def compute(self, pod: int, tokens: int):
        seconds = tokens / self.config.prefill_tokens_per_s
        start = self.env.now
        if seconds > 0:
            yield self.env.timeout(seconds)
        self.gpu_busy[pod].append((start, self.env.now))

    def store(self, outcome: Outcome) -> None:
        arrival = outcome.arrival
        chunk = self.config.chunk_tokens
        first_new = arrival.hit_tokens // chunk
        new = arrival.prompt_tokens // chunk - first_new
        if self.config.store_new_chunks and new > 0:
            self.transfer(first_new, new)

    # -- the pods ---------------------------------------------------------
    def sync_pod(self, pod: int):
        while True:
            outcome: Outcome = yield self.queues[pod].get()
            arrival = outcome.arrival
            if arrival.hit_tokens:
                start = self.env.now
                yield self.transfer(0, arrival.hit_tokens // self.config.chunk_tokens)  # the pod is frozen
                outcome.load_s = self.env.now - start
            yield from self.compute(pod, arrival.prompt_tokens - arrival.hit_tokens)
            outcome.first_token_s = self.env.now
            self.store(outcome)

    def async_pod(self, pod: int):
        while True:
            outcome, tokens = yield self.queues[pod].get()
            yield from self.compute(pod, tokens)
            outcome.first_token_s = self.env.now
            self.store(outcome)

    def async_lookup(self, outcome: Outcome):
        """Prefetch on arrival; schedule on completion or at the timeout (then recompute it all)."""
        arrival = outcome.arrival
        if not arrival.hit_tokens:
            yield self.queues[outcome.pod].put((outcome, arrival.prompt_tokens))
            return
        start = self.env.now
        prefetch = self.transfer(0, arrival.hit_tokens // self.config.chunk_tokens)
        timeout = self.env.timeout(self.config.async_timeout_s)
        yield prefetch | timeout
        if prefetch.triggered:
            outcome.load_s = self.env.now - start
            yield self.queues[outcome.pod].put((outcome, arrival.prompt_tokens - arrival.hit_tokens))
        else:
            outcome.timed_out = True
            outcome.load_s = self.config.async_timeout_s
            yield self.queues[outcome.pod].put((outcome, arrival.prompt_tokens))

    def source(self, outcomes: list[Outcome]):
        for outcome in outcomes:
            delay = outcome.arrival.arrival_s - self.env.now
            if delay > 0:
                yield self.env.timeout(delay)
            if self.config.loading == "sync":
                yield self.queues[outcome.pod].put(outcome)
            else:
                self.env.process(self.async_lookup(outcome))


def simulate(config: CellConfig, arrivals: Sequence[Arrival]) -> SimResult:
    """Run every arrival through the cell until the last first token."""
    config.validate()
    env = simpy.Environment()
    cell = _Cell(env, config)
    cell.shards = [simpy.Resource(env, capacity=1) for _ in range(config.shards)]
    cell.shard_busy = [[] for _ in range(config.shards)]
    cell.gpu_busy = [[] for _ in range(config.pods)]
    cell.queues = [simpy.Store(env) for _ in range(config.pods)]
    ordered = sorted(arrivals, key=lambda a: a.arrival_s)
    outcomes = [Outcome(arrival, index % config.pods) for index, arrival in enumerate(ordered)]
    for pod in range(config.pods):
        env.process(cell.sync_pod(pod) if config.loading == "sync" else cell.async_pod(pod))
    env.process(cell.source(outcomes))
    env.run()  # until no event is left: every request served, every background transfer done
    ends = [o.first_token_s for o in outcomes if o.first_token_s is not None]
    ends += [busy[-1][1] for busy in cell.shard_busy if busy]
    return SimResult(config, outcomes, cell.shard_busy, cell.gpu_busy, max(ends, default=0.0))


def busy_per_window(intervals: Sequence[tuple[float, float]], end_s: float, window_s: float) -> list[float]:
    """The busy share of each window ``[k * window_s, (k + 1) * window_s)`` up to ``end_s``."""
    windows = max(1, math.ceil(end_s / window_s))
    busy = [0.0] * windows
    for start, stop in intervals:
        k = int(start // window_s)
        while start < stop and k < windows:
            edge = min(stop, (k + 1) * window_s)
            busy[k] += edge - start
            start, k = edge, k + 1
    return [b / window_s for b in busy]
