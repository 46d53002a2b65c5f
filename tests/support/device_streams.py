"""CUDA's stream ordering on CPU, for proofs about which stream device work runs on.

On a GPU, work queued on one stream runs in the order it was queued; work on
two streams is unordered unless one waits for the other (``wait_stream``, an
event) or the host synchronizes. A read on one stream of a buffer that another
stream is still writing is a race, and shows only when the timing lets it.

``DeviceStreams`` stands in for LMCache's ``torch_dev`` and takes, for one kind
of device work, the latest completion those rules allow: a tensor broadcast's
delivery into the receiving rank's tensor. That is what gloo's and NCCL's
broadcasts of device tensors do: the bytes arrive on a stream of their own,
and the caller's *current* stream is made to wait for them, no other stream.
Here the delivery is queued on the stream current at the call and lands when
that stream is drained: when work is launched on that stream (behind it, in
order), when the stream is synchronized or another stream waits for it, and at
a device-wide synchronize. Other work runs at once, as on an idle GPU.

So a consumer on another stream that does not wait reads the tensor as it was
before the broadcast, every time: the race a GPU shows now and then is certain
here. A consumer ordered after the broadcast reads what was broadcast.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator


class ModelStream:
    """A stream whose queued work runs when it is drained."""

    def __init__(self, device: "DeviceStreams", name: str) -> None:
        self.device = device
        self.name = name
        self._pending: list[Callable[[], Any]] = []

    def enqueue(self, work: Callable[[], Any]) -> None:
        self._pending.append(work)

    def drain(self) -> None:
        while self._pending:
            self._pending.pop(0)()

    def synchronize(self) -> None:
        self.drain()

    def wait_stream(self, other: "ModelStream") -> None:
        other.drain()

    def wait_event(self, event: "ModelEvent") -> None:
        event.synchronize()

    def record_event(self, event: "ModelEvent | None" = None) -> "ModelEvent":
        event = event or ModelEvent(self.device)
        event.record(self)
        return event

    def query(self) -> bool:
        return not self._pending

    def __repr__(self) -> str:
        return f"ModelStream({self.name}, {len(self._pending)} pending)"


class ModelEvent:
    """An event: waiting for it drains the stream it was recorded on."""

    def __init__(self, device: "DeviceStreams", *args: Any, **kwargs: Any) -> None:
        self.device = device
        self._stream: ModelStream | None = None

    def record(self, stream: ModelStream | None = None) -> None:
        self._stream = stream or self.device.current_stream()

    def wait(self, stream: ModelStream | None = None) -> None:
        self.synchronize()

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.drain()

    def query(self) -> bool:
        return self._stream is None or self._stream.query()


class DeviceStreams:
    """A ``torch_dev`` whose streams order work as CUDA's do (see the module
    docstring); what it does not model it takes from ``base``."""

    def __init__(self, base: Any) -> None:
        self._base = base
        self.default = ModelStream(self, "default")
        self._streams = [self.default]
        self._current = self.default

    def Stream(self, *args: Any, **kwargs: Any) -> ModelStream:  # noqa: N802 - torch_dev's name
        stream = ModelStream(self, f"stream-{len(self._streams)}")
        self._streams.append(stream)
        return stream

    def Event(self, *args: Any, **kwargs: Any) -> ModelEvent:  # noqa: N802 - torch_dev's name
        return ModelEvent(self, *args, **kwargs)

    def current_stream(self, device: Any = None) -> ModelStream:
        return self._current

    def default_stream(self, device: Any = None) -> ModelStream:
        return self.default

    def set_stream(self, stream: ModelStream) -> None:
        self._current = stream

    @contextlib.contextmanager
    def stream(self, stream: ModelStream | None = None) -> Iterator[ModelStream | None]:
        previous = self._current
        if stream is not None:
            self._current = stream
        try:
            yield stream
        finally:
            self._current = previous

    def synchronize(self, device: Any = None) -> None:
        while any(not stream.query() for stream in self._streams):
            for stream in self._streams:
                stream.drain()

    def launch(self, work: Callable[[], Any]) -> Any:
        """Device work launched on the current stream: it runs after the work
        queued there before it, and at once otherwise."""
        self._current.drain()
        return work()

    def deliver(self, work: Callable[[], Any]) -> None:
        """Device work only the current stream waits for: it lands when that
        stream is drained."""
        self._current.enqueue(work)

    def ordered_broadcasts(self, collectives: Any) -> Any:
        """The same collectives (a PCPCollectives), whose tensor broadcast
        delivers into the receiving rank's tensor on the current stream. The
        bytes travel at the call (the sender's tensor is read then, as gloo
        and NCCL read it once the caller's stream has written it)."""
        import torch

        send = collectives.broadcast

        def broadcast(tensor, src):
            if src == collectives.rank:
                return send(tensor, src)
            arrived = torch.empty_like(tensor)
            send(arrived, src)

            def land() -> None:
                # The retrieve runs under inference mode; its buffer may be
                # drained into after the retrieve has returned.
                with torch.inference_mode(tensor.is_inference()):
                    tensor.copy_(arrived)

            self.deliver(land)
            return tensor

        ordered = dataclasses.replace(collectives, broadcast=broadcast)
        if hasattr(collectives, "log"):
            object.__setattr__(ordered, "log", collectives.log)
        return ordered

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)
