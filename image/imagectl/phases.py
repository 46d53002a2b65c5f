"""Cold-start phases of a vLLM engine, read from its own log lines, and the process that follows them.

A role preset's first start on a GPU node spends its time in four phases: loading the
weights, torch.compile, FlashInfer's JIT (compiling a module and fetching its cubins when the
image does not carry them) and CUDA graph capture. The entrypoint runs vLLM as a child, passes
its output through unchanged, and prints, on stderr:

    entrypoint: phase weights started at +5.1 s (2026-05-06T12:00:05Z)
    ...
    entrypoint: cold start: weights 412.3 s (from +5.1 s); compile 95.2 s (from +420.0 s); ...; ready at +612.4 s

The markers are vLLM 0.31.0's and FlashInfer 0.7.0.post1's own messages (``MARKERS``).
A line that carries vLLM's own duration ("Loading weights took 412.30 seconds") dates the
phase's start back by it, so a start whose first line was missed is still placed. Each
phase spans from its first marker in any process to its last end marker, so the eight
workers of a role count as one.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import BinaryIO, Callable

PHASES = ("weights", "compile", "flashinfer jit", "graph capture")


@dataclass(frozen=True)
class Marker:
    phase: str
    pattern: re.Pattern[str]
    ends: bool = False   # the phase's end (its last such line ends it)


def _m(phase: str, pattern: str, ends: bool = False) -> Marker:
    return Marker(phase, re.compile(pattern), ends)


# ``took``: seconds the phase had run when the line was printed (vLLM's own figure).
MARKERS = (
    _m("weights", r"Starting to load model"),                               # gpu_model_runner.py
    _m("weights", r"Loading weights took (?P<took>[\d.]+) seconds", ends=True),   # default_loader.py
    _m("weights", r"Model loading took \S+ GiB memory and (?P<took>[\d.]+) seconds", ends=True),
    _m("compile", r"Dynamo bytecode transform time: (?P<took>[\d.]+) s"),   # compilation/backends.py
    _m("compile", r"Compiling a graph for compile range"),
    _m("compile", r"Directly load the compiled graph"),                     # torch.compile cache hit
    _m("compile", r"torch\.compile (?:and initial profiling/warmup run together )?took (?P<took>[\d.]+) s in total",
       ends=True),                                                          # compilation/monitor.py, decorators.py
    _m("flashinfer jit", r"flashinfer\.jit: Building JIT module (?P<module>[^\s;]+)"),   # flashinfer/jit/core.py
    _m("flashinfer jit", r"flashinfer\.jit: Fetching (?P<file>\S+) from"),               # jit/cubin_loader.py
    _m("graph capture", r"Torch profiler (?:enabled|disabled) for CUDA graph capture"),   # V1 runner, each rank
    _m("graph capture", r"Capturing CUDA graphs"),                          # the capture's progress bar
    _m("graph capture", r"Graph capturing finished in (?P<took>[\d.]+) secs", ends=True),
)
# The API server listens: every engine has loaded, compiled and captured.
READY = re.compile(r"Starting vLLM server on|Application startup complete")


@dataclass
class Phase:
    start: float | None = None
    end: float | None = None
    modules: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)


class Tracker:
    """Phase start and end times (seconds since the engine was started) from log lines."""

    def __init__(self, started: float, wall: float, emit: Callable[[str], None]) -> None:
        self.started = started        # the clock's value at the engine's start
        self.wall = wall              # time.time() at the engine's start
        self.emit = emit
        self.phases = {name: Phase() for name in PHASES}
        self.ready: float | None = None
        self.summarized = False

    def line(self, text: str, now: float) -> None:
        at = now - self.started
        for marker in MARKERS:
            match = marker.pattern.search(text)
            if match:
                self._mark(marker, match, at)
        if self.ready is None and READY.search(text):
            self.ready = at
            self.emit(self.summary())
            self.summarized = True

    def _mark(self, marker: Marker, match: re.Match[str], at: float) -> None:
        phase = self.phases[marker.phase]
        took = match.groupdict().get("took")
        began = max(0.0, at - float(took)) if took else at
        first = phase.start is None
        if first or began < phase.start:
            phase.start = began
        if first:
            clock = datetime.fromtimestamp(self.wall + began, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            self.emit(f"phase {marker.phase} started at +{began:.1f} s ({clock})")
        if marker.ends:
            phase.end = at if phase.end is None else max(phase.end, at)
        groups = match.groupdict()
        if groups.get("module"):
            phase.modules.add(groups["module"])
        if groups.get("file"):
            phase.files.add(groups["file"])

    def _describe(self, name: str) -> str:
        phase = self.phases[name]
        if phase.start is None:
            return f"{name} not seen"
        if name == "flashinfer jit":
            return (f"{name}: {len(phase.modules)} module(s) built, {len(phase.files)} file(s) fetched "
                    f"(from +{phase.start:.1f} s)")
        if phase.end is None:
            return f"{name} unfinished (from +{phase.start:.1f} s)"
        return f"{name} {phase.end - phase.start:.1f} s (from +{phase.start:.1f} s)"

    def summary(self, exit_code: int | None = None) -> str:
        parts = "; ".join(self._describe(name) for name in PHASES)
        if self.ready is not None:
            return f"cold start: {parts}; ready at +{self.ready:.1f} s"
        return f"cold start (vLLM exited {exit_code} before it was ready): {parts}"


class Output:
    """One of the entrypoint's streams, shared by the engine's bytes and the tracker's lines:
    a line of ours never lands in the middle of one of the engine's (a progress bar's \\r)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.at_line_start = True

    def write(self, data: bytes) -> None:
        with self.lock:
            self.stream.write(data)
            self.stream.flush()
            if data:
                self.at_line_start = data.endswith((b"\n", b"\r"))

    def say(self, text: str) -> None:
        with self.lock:
            lead = b"" if self.at_line_start else b"\n"
            self.stream.write(lead + f"entrypoint: {text}\n".encode())
            self.stream.flush()
            self.at_line_start = True


class Lines:
    """Bytes in, complete lines out (split at \\n and at a progress bar's \\r)."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, data: bytes) -> list[str]:
        parts = re.split(rb"[\r\n]", self.pending + data)
        self.pending = parts.pop()
        return [p.decode("utf-8", "replace") for p in parts if p]

    def flush(self) -> list[str]:
        rest, self.pending = self.pending, b""
        return [rest.decode("utf-8", "replace")] if rest else []


def _pump(source: BinaryIO, dest: Output, tracker: Tracker, lock: threading.Lock,
          clock: Callable[[], float]) -> None:
    lines = Lines()
    fd = source.fileno()
    while True:
        data = os.read(fd, 65536)
        dest.write(data)
        found = lines.feed(data) if data else lines.flush()
        if found:
            now = clock()
            with lock:
                for text in found:
                    tracker.line(text, now)
        if not data:
            return


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def run(argv: list[str], env: dict[str, str], stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
        clock: Callable[[], float] = time.monotonic) -> int:
    """Run ``argv``, pass its output through, print the phases; its exit status (128+N for signal N).

    The engine gets a process group of its own, so a terminal's Ctrl-C reaches it once, through
    here, as does every signal the container's init passes to the entrypoint."""
    out = Output(stdout or sys.stdout.buffer)
    err = Output(stderr or sys.stderr.buffer)
    try:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0)
    except FileNotFoundError:
        err.say(f"{argv[0]}: not found")
        return 127
    tracker = Tracker(clock(), time.time(), err.say)
    previous = {sig: signal.signal(sig, lambda number, _frame: proc.send_signal(number)) for sig in FORWARDED}
    lock = threading.Lock()
    pumps = [threading.Thread(target=_pump, args=(pipe, dest, tracker, lock, clock), daemon=True)
             for pipe, dest in ((proc.stdout, out), (proc.stderr, err))]
    try:
        for pump in pumps:
            pump.start()
        code = proc.wait()
        for pump in pumps:   # the engine's own children may hold the pipes a little longer
            pump.join(timeout=30)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = code if code >= 0 else 128 - code
    with lock:
        if not tracker.summarized:
            err.say(tracker.summary(code))
    return code
