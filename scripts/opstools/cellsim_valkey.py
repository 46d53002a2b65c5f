"""One Valkey instance in the simulator: a single main thread shared by every client's GETs in flight.

Valkey executes every command on one main thread, and its event loop serves
the connections that have a command ready in turn. A *client* is one rank of
one pod (LMCache's connector there); a *stream* is what one load asks of one
instance through one client: that rank's chunks of a request (the sharded
store), every chunk of a request (the rank-0 store), or a request's SETs. A
client's streams are served in the order it sent them (its connector works
through one queue); the thread is shared equally by the clients that have a
stream in flight (processor sharing), so the loads of different ranks and
pods interleave.

They compete for more than turns: with ``n`` clients in flight one GET costs
the thread ``get_s * (1 + contention * (n - 1))``, so the instance delivers
fewer bytes per second the more clients read it at once. ``contention = 0`` is
a constant-speed server.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import simpy

_DONE = 1e-9  # GETs left below this count as none (floating-point rest of the shares)


@dataclass(eq=False)
class Stream:
    """``gets`` GETs (or SETs) of one load at one instance; ``done`` fires when the last one ends."""

    gets: float
    done: simpy.Event
    client: Hashable = None
    shard: Shard | None = None
    left: float = field(init=False)
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.left = float(self.gets)

    def cancel(self) -> None:
        """Drop what is left of the stream (a prefetch nobody waits for); its ``done`` never fires."""
        if self.shard is not None and not self.done.triggered:
            self.shard.cancel(self)


class Shard:
    """A Valkey instance: ``read`` queues a stream behind its client's earlier ones."""

    def __init__(self, env: simpy.Environment, get_s: float, contention: float) -> None:
        self.env = env
        self.get_s = get_s
        self.contention = contention
        self.queues: dict[Hashable, deque[Stream]] = {}  # per client, oldest first
        self.busy: list[tuple[float, float]] = []  # (start, end) of each stretch the thread worked
        self._arriving: list[Stream] = []  # queued once the time up to now is accounted for
        self._wake = env.event()
        env.process(self._serve())

    def get_time(self, clients: int) -> float:
        """Thread time of one GET with ``clients`` clients in flight."""
        return self.get_s * (1 + self.contention * (clients - 1))

    def read(self, gets: int, client: Hashable = None) -> Stream:
        stream = Stream(gets, self.env.event(), client, self)
        if gets <= 0:
            stream.done.succeed()
            return stream
        self._arriving.append(stream)
        self._poke()
        return stream

    def cancel(self, stream: Stream) -> None:
        stream.cancelled = True
        if stream in self._arriving:
            self._arriving.remove(stream)
        queue = self.queues.get(stream.client)
        if queue is not None and stream in queue:
            queue.remove(stream)
            if not queue:
                del self.queues[stream.client]
            self._poke()

    def _poke(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _mark_busy(self, start: float, end: float) -> None:
        if end <= start:
            return
        if self.busy and self.busy[-1][1] >= start - 1e-12:
            self.busy[-1] = (self.busy[-1][0], end)
        else:
            self.busy.append((start, end))

    def _admit(self) -> None:
        for stream in self._arriving:
            self.queues.setdefault(stream.client, deque()).append(stream)
        self._arriving.clear()

    def _serve(self):
        while True:
            self._admit()
            if not self.queues:
                yield self._wake
                self._wake = self.env.event()
                continue
            heads = [queue[0] for queue in self.queues.values()]
            per_get_s = len(heads) * self.get_time(len(heads))  # time one client needs per GET of its own
            start = self.env.now
            yield self.env.timeout(min(s.left for s in heads) * per_get_s) | self._wake
            if self._wake.triggered:
                self._wake = self.env.event()
            progress = (self.env.now - start) / per_get_s
            self._mark_busy(start, self.env.now)
            for stream in heads:
                if stream.cancelled:
                    continue
                stream.left -= progress
                if stream.left <= _DONE:
                    queue = self.queues[stream.client]
                    queue.popleft()
                    if not queue:
                        del self.queues[stream.client]
                    stream.done.succeed()
