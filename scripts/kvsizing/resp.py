"""A short, bounded GET-bandwidth benchmark against one Valkey/Redis instance.

Only the standard library: a minimal RESP2 client over a socket. It writes a
few values of the real chunk size under a unique prefix, reads them back from
several connections in parallel (as LMCache's RESP connector does with its
resp_num_threads connections) for a fixed time or GET count, deletes them,
and reports the bytes delivered per second of wall time.

It writes chunk_bytes x keys into the instance (100 MB by default); on a
shard under LRU pressure that evicts as much real cache.
"""
from __future__ import annotations

import os
import re
import socket
import statistics
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

LIMITS = {"seconds": 60.0, "connections": 64, "keys": 64, "max_gets": 100_000, "chunk_bytes": 512 * 1024 * 1024}


class MeasureError(RuntimeError):
    """The benchmark could not run or could not finish."""


def parse_resp_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("resp", "redis", "valkey") or not parts.hostname:
        raise ValueError(f"{url!r}: expected resp://HOST:PORT")
    if "{" in url:
        raise ValueError(f"{url!r}: a template; give one instance's URL (e.g. rank 0's shard)")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"{url!r}: bad port") from None
    return parts.hostname, port


class RespClient:
    def __init__(self, host: str, port: int, timeout: float):
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise MeasureError(f"cannot connect to {host}:{port}: {e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb", buffering=1 << 20)

    def close(self) -> None:
        try:
            self.reader.close()
        finally:
            self.sock.close()

    def send(self, *args: bytes | str | int) -> None:
        out = [b"*%d\r\n" % len(args)]
        for arg in args:
            data = arg if isinstance(arg, (bytes, bytearray, memoryview)) else str(arg).encode()
            out.append(b"$%d\r\n" % len(data))
            out.append(bytes(data) if isinstance(data, memoryview) else data)
            out.append(b"\r\n")
        self.sock.sendall(b"".join(out))

    def _line(self) -> bytes:
        line = self.reader.readline()
        if not line.endswith(b"\r\n"):
            raise MeasureError("connection closed by the server")
        return line[:-2]

    def reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise MeasureError(f"server error: {rest.decode(errors='replace')}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            data = self._exact(size + 2)
            return data[:-2]
        if kind == b"*":
            return [self.reply() for _ in range(int(rest))]
        raise MeasureError(f"unexpected reply {line[:40]!r}")

    def _exact(self, size: int) -> bytes:
        data = self.reader.read(size)
        if data is None or len(data) != size:
            raise MeasureError("connection closed in the middle of a reply")
        return data

    def command(self, *args):
        self.send(*args)
        return self.reply()

    def get_into(self, key: str, buf: bytearray) -> int:
        """GET key into buf (sized for the value); returns the value's size."""
        self.send("GET", key)
        header = self._line()
        if header[:1] == b"-":
            raise MeasureError(f"server error: {header[1:].decode(errors='replace')}")
        if header[:1] != b"$":
            raise MeasureError(f"unexpected GET reply {header[:40]!r}")
        size = int(header[1:])
        if size < 0:
            raise MeasureError(f"key {key} vanished during the benchmark (evicted?)")
        if size > len(buf):
            raise MeasureError(f"value of {size} bytes, expected at most {len(buf)}")
        view = memoryview(buf)[:size]
        got = 0
        while got < size:
            n = self.reader.readinto(view[got:])
            if not n:
                raise MeasureError("connection closed in the middle of a value")
            got += n
        if self._exact(2) != b"\r\n":
            raise MeasureError("malformed bulk reply")
        return size


@dataclass
class Measurement:
    url: str
    chunk_bytes: int
    keys: int
    connections: int
    gets: int
    bytes: int
    seconds: float
    bandwidth: float  # bytes/s
    get_p50_ms: float
    get_p99_ms: float
    server: str

    def as_dict(self) -> dict:
        return asdict(self)


def _bounded(name: str, value, low) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= LIMITS[name]):
        raise ValueError(f"{name}: expected {low}..{LIMITS[name]}, got {value!r}")


def measure(url: str, chunk_bytes: int = 12_400_000, keys: int = 8, connections: int = 4,
            seconds: float = 2.0, max_gets: int = 400, timeout: float = 10.0) -> Measurement:
    """GET bandwidth of one instance with values of chunk_bytes; bounded in time and count."""
    host, port = parse_resp_url(url)
    _bounded("chunk_bytes", chunk_bytes, 1)
    _bounded("keys", keys, 1)
    _bounded("connections", connections, 1)
    _bounded("seconds", seconds, 0.05)
    _bounded("max_gets", max_gets, 1)
    chunk_bytes, keys, connections, max_gets = int(chunk_bytes), int(keys), int(connections), int(max_gets)

    prefix = f"kv-sizing:bench:{uuid.uuid4().hex}:"
    names = [f"{prefix}{i}" for i in range(keys)]
    admin = RespClient(host, port, timeout)
    try:
        if admin.command("PING") != "PONG":
            raise MeasureError(f"{url}: PING did not answer PONG")
        info = admin.command("INFO", "server") or b""
        server = "unknown"
        for field in (b"valkey_version", b"redis_version"):  # Valkey reports both
            version = re.search(field + rb":(\S+)", info)
            if version:
                server = f"{field.decode().split('_')[0]} {version.group(1).decode()}"
                break
        payload = os.urandom(chunk_bytes)
        for name in names:
            if admin.command("SET", name, payload) != "OK":
                raise MeasureError(f"SET {name} was refused")
        del payload

        lock = threading.Lock()
        issued = 0
        latencies: list[float] = []
        errors: list[BaseException] = []
        total = 0
        ready = threading.Barrier(connections + 1)  # every connection open
        go = threading.Event()  # set once the deadline is known
        deadline = [0.0]

        def worker(index: int) -> None:
            nonlocal issued, total
            buf = bytearray(chunk_bytes)
            client = None
            try:
                client = RespClient(host, port, timeout)
                ready.wait()
                go.wait()
                k = index
                while time.monotonic() < deadline[0]:
                    with lock:
                        if issued >= max_gets:
                            return
                        issued += 1
                    t0 = time.perf_counter()
                    n = client.get_into(names[k % keys], buf)
                    dt = time.perf_counter() - t0
                    with lock:
                        total += n
                        latencies.append(dt)
                    k += connections
            except BaseException as e:  # reported after the join
                errors.append(e)
                ready.abort()
            finally:
                if client is not None:
                    client.close()

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(connections)]
        for t in threads:
            t.start()
        try:
            ready.wait(timeout=timeout)
        except threading.BrokenBarrierError:
            pass
        t_start = time.monotonic()
        deadline[0] = t_start + seconds
        go.set()
        for t in threads:
            t.join(timeout=seconds + timeout + 5)
        elapsed = time.monotonic() - t_start
        if any(t.is_alive() for t in threads):
            raise MeasureError("a benchmark connection did not finish in time")
        if errors:
            e = errors[0]
            raise MeasureError(str(e)) from (e if not isinstance(e, MeasureError) else None)
        if not latencies:
            raise MeasureError("no GET completed")
        lat = sorted(latencies)
        return Measurement(
            url=url, chunk_bytes=chunk_bytes, keys=keys, connections=connections, gets=len(lat), bytes=total,
            seconds=elapsed, bandwidth=total / elapsed, get_p50_ms=statistics.median(lat) * 1e3,
            get_p99_ms=lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))] * 1e3, server=server,
        )
    finally:
        try:
            admin.command("DEL", *names)
        except (MeasureError, OSError):
            pass
        admin.close()
