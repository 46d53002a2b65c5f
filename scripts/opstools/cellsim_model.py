"""A discrete-event model (SimPy) of prefill pods loading KV from Valkey instances.

What is modelled, and how (the parameters: ``cellsim_config``; their defaults
and the measurements they come from: ``cellsim_defaults``):

- **Requests** arrive at their send times (a Poisson stream or a trace,
  ``cellsim_arrivals``) and go to the pods round-robin, as vLLM's P/D toy
  proxy routes them. Each has ``prompt_tokens`` and ``hit_tokens``: the prefix
  whose chunks are in L2 (whole chunks of ``chunk_tokens``); a lookup finds it
  up to the first chunk on a lost instance.
- **Valkey instances** (``cellsim_valkey``): one main thread per instance,
  shared by the clients (one per rank of a pod) with GETs or SETs in flight,
  each client's transfers in the order it sent them; a GET costs ``get_s``
  with one client in flight and ``get_contention`` of that more per further
  one.
- **Which instance serves a chunk**: with the sharded store chunk ``c``
  belongs to rank ``c mod W`` and rank ``r`` reads instance ``r mod N`` (rank
  r of every pod shares instance r). With the rank-0 store rank 0 reads every
  chunk from instance 0.
- **Pods** run their PCP group in lockstep, so a pod is one server that runs
  steps. A step takes the waiting requests first come first served while
  their uncached tokens fit ``step_tokens`` and they number at most
  ``step_requests`` (a request longer than the budget runs alone, its GPU
  work in ``ceil(tokens / step_tokens)`` steps). Every request of a step gets
  its first token at the step's end.
- **Synchronous** loading loads inside the step, one request after another
  (LMCache's ``start_load_kv`` retrieves request by request): the pod is
  frozen until every rank's GETs of that request are done, then spends
  ``engine_load_s_per_chunk`` per loaded chunk (the exchange, the per-chunk
  broadcast and the copies). **Asynchronous** loading starts a prefetch on
  arrival and makes the request ready when it completes, or after
  ``async_timeout_s``, whichever is first. The step then spends
  ``step_copy_s_per_chunk`` of the engine time on each prefetched chunk (the
  owner's copy into GPU memory before the chunk's broadcast, which only the
  step can do); the rest the prefetch spends before the request is ready
  (``async_load_path`` "prefetch": "a slow load delays only its own request,
  while the engine keeps running others"), or the pod's one background
  loader spends it, prefetch after prefetch, outside the step ("loader"), or
  the step spends all of it ("step"). On a timeout the whole prompt is
  recomputed while the prefetch keeps running (an *orphan*: its GETs still
  occupy the instances), up to ``orphan_cap`` orphans per pod; the prefetch
  of a request that times out beyond the cap is cancelled.
- **GPU work** of a step is its uncached tokens at ``prefill_tokens_per_s``,
  ``gpu_load_s_per_chunk`` for each chunk any of its requests loaded (the
  sharded load is "one broadcast per chunk from its owner", a collective on
  the GPUs, inside the step), plus ``gpu_step_s`` per step; the GETs, the
  engine's load path and a frozen pod's wait are not GPU work.
- **Stores**: after its step a request SETs, in the background, the chunks
  past what its lookup reported (LMCache saves from there): the chunks not in
  L2, or after a timeout (0 reported) the whole prompt. Their copy to CPU
  inside the step is not modelled.
- **Time to first token** is the end of the request's step: no decode,
  network, tokenizer or HTTP time, no lookup (EXISTS) cost, no L1 hits.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import simpy

from .cellsim_arrivals import Arrival, poisson_arrivals
from .cellsim_config import CellConfig
from .cellsim_valkey import Shard, Stream

__all__ = ["Arrival", "CellConfig", "Outcome", "SimResult", "busy_per_window", "poisson_arrivals", "simulate"]


@dataclass
class Outcome:
    arrival: Arrival
    pod: int
    first_token_s: float | None = None
    timed_out: bool = False  # async: the lookup timeout fired and the prompt was recomputed
    load_s: float = 0.0  # sync: the load inside the step; async: the prefetch (or the timeout)
    gets_s: float = 0.0  # async: the prefetch's GETs alone (0 after a timeout)
    batch: int = 0  # requests in the step that gave the first token

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival.arrival_s


@dataclass
class SimResult:
    config: CellConfig
    outcomes: list[Outcome]
    shard_busy: list[list[tuple[float, float]]]  # per instance: (start, end) of each stretch its thread worked
    gpu_busy: list[list[tuple[float, float]]]  # per pod: (start, end) of each step's GPU work
    end_s: float  # the last first token or the end of the last transfer, whichever is later
    steps: int = 0

    @property
    def makespan_s(self) -> float:
        return self.end_s

    @property
    def last_token_s(self) -> float:
        return max((o.first_token_s for o in self.outcomes if o.first_token_s is not None), default=0.0)

    def shard_utilisation(self) -> list[float]:
        span = self.end_s or 1.0
        return [sum(b - a for a, b in busy) / span for busy in self.shard_busy]

    def gpu_busy_fraction(self) -> float:
        """GPU work over the pods' time until the last first token (the run as a replay sees it)."""
        span = self.last_token_s or 1.0
        return sum(b - a for busy in self.gpu_busy for a, b in busy) / (span * len(self.gpu_busy))

    def timeout_share(self) -> float:
        return sum(o.timed_out for o in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0


class _Waiting:
    """A pod's queue: first come first served, with an event that fires when something is put."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.items: deque = deque()
        self._signal = env.event()

    def put(self, item) -> None:
        self.items.append(item)
        if not self._signal.triggered:
            self._signal.succeed()

    def arrival(self) -> simpy.Event:
        """An event that fires at the next put (wait on it only while the queue is empty)."""
        if self._signal.triggered:
            self._signal = self.env.event()
        return self._signal


@dataclass
class _Ready:
    outcome: Outcome
    tokens: int  # to compute
    loaded_chunks: int  # prefetched, for the engine's load path


@dataclass
class _Cell:
    env: simpy.Environment
    config: CellConfig
    shards: list[Shard] = field(default_factory=list)
    gpu_busy: list[list[tuple[float, float]]] = field(default_factory=list)
    queues: list[_Waiting] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)
    loaders: list[simpy.Resource] = field(default_factory=list)
    steps: int = 0

    def transfer(self, pod: int, first_chunk: int, chunks: int) -> list[Stream]:
        """The streams that move the chunks, each through its rank's client on the pod."""
        return [self.shards[shard].read(gets, (pod, rank))
                for rank, shard, gets in self.config.streams(first_chunk, chunks)]

    def hit_chunks(self, arrival: Arrival) -> int:
        return self.config.found_chunks(arrival.hit_tokens // self.config.chunk_tokens)

    def uncached(self, arrival: Arrival) -> int:
        return arrival.prompt_tokens - self.hit_chunks(arrival) * self.config.chunk_tokens

    def store(self, outcome: Outcome) -> None:
        # LMCache saves past the tokens its lookup reported: after a timeout (0 reported) the whole prompt
        first_new = 0 if outcome.timed_out else self.hit_chunks(outcome.arrival)
        new = outcome.arrival.prompt_tokens // self.config.chunk_tokens - first_new
        if self.config.store_new_chunks and new > 0:
            self.transfer(outcome.pod, first_new, new)

    def take_batch(self, pod: int, tokens_of) -> list:
        """The step's requests: first come first served within the token and request budgets."""
        queue = self.queues[pod].items
        batch = [queue.popleft()]
        tokens = tokens_of(batch[0])
        while queue and len(batch) < self.config.step_requests:
            more = tokens_of(queue[0])
            if tokens + more > self.config.step_tokens:
                break
            batch.append(queue.popleft())
            tokens += more
        return batch

    def gpu_work(self, pod: int, tokens: int, loaded_chunks: int):
        sub_steps = max(1, math.ceil(tokens / self.config.step_tokens))
        seconds = (self.config.compute_s(tokens) + sub_steps * self.config.gpu_step_s
                   + loaded_chunks * self.config.gpu_load_s_per_chunk)
        start = self.env.now
        if seconds > 0:
            yield self.env.timeout(seconds)
        self.gpu_busy[pod].append((start, self.env.now))
        self.steps += sub_steps

    def finish(self, batch: list[Outcome]) -> None:
        for outcome in batch:
            outcome.first_token_s = self.env.now
            outcome.batch = len(batch)
            self.store(outcome)

    # -- synchronous loading: the load is inside the step -------------------------------------
    def sync_load(self, outcome: Outcome):
        chunks = self.hit_chunks(outcome.arrival)
        if not chunks:
            return
        start = self.env.now
        yield self.env.all_of([s.done for s in self.transfer(outcome.pod, 0, chunks)])
        if self.config.engine_load_s_per_chunk > 0:
            yield self.env.timeout(chunks * self.config.engine_load_s_per_chunk)
        outcome.load_s = self.env.now - start

    def sync_pod(self, pod: int):
        while True:
            if not self.queues[pod].items:
                yield self.queues[pod].arrival()
            batch = self.take_batch(pod, lambda o: self.uncached(o.arrival))
            for outcome in batch:
                yield from self.sync_load(outcome)
            loaded = sum(self.hit_chunks(o.arrival) for o in batch)
            yield from self.gpu_work(pod, sum(self.uncached(o.arrival) for o in batch), loaded)
            self.finish(batch)

    # -- asynchronous loading: prefetch on arrival, the step only copies what was fetched ------
    def async_pod(self, pod: int):
        while True:
            if not self.queues[pod].items:
                yield self.queues[pod].arrival()
            batch: list[_Ready] = self.take_batch(pod, lambda r: r.tokens)
            loaded = sum(r.loaded_chunks for r in batch)
            engine_s = loaded * self.config.in_step_s_per_chunk()
            if engine_s > 0:
                yield self.env.timeout(engine_s)
            yield from self.gpu_work(pod, sum(r.tokens for r in batch), loaded)
            self.finish([r.outcome for r in batch])

    def async_lookup(self, outcome: Outcome):
        """Prefetch on arrival; ready on completion or at the timeout (then recompute it all)."""
        arrival = outcome.arrival
        queue = self.queues[outcome.pod]
        chunks = self.hit_chunks(arrival)
        if not chunks:
            queue.put(_Ready(outcome, arrival.prompt_tokens, 0))
            return
        start = self.env.now
        streams = self.transfer(outcome.pod, 0, chunks)
        prefetch = self.env.process(self.prefetch(outcome, streams, chunks))
        yield prefetch | self.env.timeout(self.config.async_timeout_s)
        if prefetch.triggered:
            outcome.load_s = self.env.now - start
            queue.put(_Ready(outcome, self.uncached(arrival), chunks))
            return
        outcome.timed_out = True
        outcome.load_s = self.config.async_timeout_s
        queue.put(_Ready(outcome, arrival.prompt_tokens, 0))
        cap = self.config.orphan_cap
        if cap is not None and self.orphans[outcome.pod] >= cap:
            for stream in streams:
                stream.cancel()
            return
        self.orphans[outcome.pod] += 1
        yield prefetch
        self.orphans[outcome.pod] -= 1

    def prefetch(self, outcome: Outcome, streams: list[Stream], chunks: int):
        """The prefetch: its GETs, then the engine's load path of its chunks that the step does not spend, on its
        own (``async_load_path`` "prefetch") or in its turn at the pod's loader ("loader")."""
        start = self.env.now
        yield self.env.all_of([s.done for s in streams])
        gets_s = self.env.now - start
        if gets_s <= self.config.async_timeout_s:
            outcome.gets_s = gets_s
        engine_s = chunks * self.config.off_step_s_per_chunk()
        if engine_s <= 0:
            return
        if self.config.async_load_path == "prefetch":
            yield self.env.timeout(engine_s)
            return
        with self.loaders[outcome.pod].request() as turn:  # a timed-out prefetch, run on, takes its turn too
            yield turn
            yield self.env.timeout(engine_s)

    def source(self, outcomes: list[Outcome]):
        for outcome in outcomes:
            delay = outcome.arrival.arrival_s - self.env.now
            if delay > 0:
                yield self.env.timeout(delay)
            if self.config.loading == "sync":
                self.queues[outcome.pod].put(outcome)
            else:
                self.env.process(self.async_lookup(outcome))


def simulate(config: CellConfig, arrivals: Sequence[Arrival]) -> SimResult:
    """Run every arrival through the cell until every request and background transfer is done."""
    config.validate()
    env = simpy.Environment()
    cell = _Cell(env, config)
    cell.shards = [Shard(env, config.get_s, config.get_contention) for _ in range(config.shards)]
    cell.gpu_busy = [[] for _ in range(config.pods)]
    cell.queues = [_Waiting(env) for _ in range(config.pods)]
    cell.orphans = [0] * config.pods
    cell.loaders = [simpy.Resource(env, capacity=1) for _ in range(config.pods)]
    ordered = sorted(arrivals, key=lambda a: a.arrival_s)
    outcomes = [Outcome(arrival, index % config.pods) for index, arrival in enumerate(ordered)]
    for pod in range(config.pods):
        env.process(cell.sync_pod(pod) if config.loading == "sync" else cell.async_pod(pod))
    env.process(cell.source(outcomes))
    env.run()  # until no event is left: every request served, every background transfer done
    shard_busy = [shard.busy for shard in cell.shards]
    ends = [o.first_token_s for o in outcomes if o.first_token_s is not None]
    ends += [busy[-1][1] for busy in shard_busy if busy]
    return SimResult(config, outcomes, shard_busy, cell.gpu_busy, max(ends, default=0.0), cell.steps)


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
