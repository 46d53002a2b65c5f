"""A RESP forwarding proxy in front of a real Valkey that runs a hook between an
EXISTS and its reply: the way to put a real deletion or eviction between
LMCache's lookup and its load.

LMCache's async prefetch (``StorageManager.async_lookup_and_prefetch``) sends
one EXISTS per chunk key and, as soon as all of them answered, the GETs of
the hits: the window is well under a millisecond, which neither a real run nor
a MONITOR client can hit on demand. This proxy is the fake that forces the
interleaving, and only that: it relays every command and reply byte for byte,
and when armed for a lookup of N keys, holds the N-th EXISTS reply (by then
Valkey has answered all N, while the keys were there) until the hook has run
against the same Valkey (a real DEL, or a real maxmemory change that makes
Valkey's own LRU evict). LMCache's EXISTS go out in parallel on several
connections, and it sends no GET of that lookup before it has every reply,
so every GET follows the hook.

Each client connection is relayed one command at a time (a pipelined client
still gets its replies in order).
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import BinaryIO

from tests.support.ports import free_loopback_port
from tests.support.valkey import ValkeyServer


def read_reply(stream: BinaryIO) -> bytes:
    """One complete RESP2 value (its raw bytes), or b"" at end of stream."""
    line = stream.readline()
    if not line:
        return b""
    if not line.endswith(b"\r\n"):
        raise ConnectionError(f"truncated RESP line {line[:40]!r}")
    kind, rest = line[:1], line[1:-2]
    if kind in (b"+", b"-", b":"):
        return line
    if kind == b"$":
        size = int(rest)
        return line if size < 0 else line + _read_exactly(stream, size + 2)
    if kind == b"*":
        count = int(rest)
        parts = [line]
        for _ in range(max(count, 0)):
            part = read_reply(stream)
            if not part:
                raise ConnectionError("stream ended inside a RESP array")
            parts.append(part)
        return b"".join(parts)
    raise ConnectionError(f"unexpected RESP type in {line[:40]!r}")


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if data is None or len(data) != size:
        raise ConnectionError(f"stream ended {size - len(data or b'')} bytes short")
    return data


def command_words(raw: bytes) -> tuple[str, str]:
    """The name and first argument of a RESP array command ("*2\\r\\n$6\\r\\nEXISTS\\r\\n$3\\r\\nkey\\r\\n")."""
    if not raw.startswith(b"*"):
        return "", ""
    lines = raw[:512].split(b"\r\n", 5)
    name = lines[2].decode(errors="replace").upper() if len(lines) > 2 else ""
    return name, lines[4].decode(errors="replace") if len(lines) > 4 else ""


def _reply_kind(reply: bytes) -> bytes:
    """What the trace keeps of a reply: an integer or status whole, a bulk string as $ (nil if missing)."""
    if reply.startswith((b":", b"+", b"-")):
        return reply[:-2][:40]
    return b"nil" if reply.startswith(b"$-1") else reply[:1]


class ExistsHookProxy:
    """Listens on ``port`` (default: a free one) and relays to ``valkey``."""

    def __init__(self, valkey: ValkeyServer, port: int | None = None):
        self.valkey = valkey
        self.port = port or free_loopback_port()
        self._hook: Callable[[], None] | None = None
        self._exists_left = 0
        self._lock = threading.Lock()
        self.fired = threading.Event()
        self.hook_error: BaseException | None = None
        self.commands: dict[str, int] = {}
        self.trace: list[tuple[str, str, bytes]] = []   # (command, first argument, reply type), in relay order
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="resp-hook-accept", daemon=True).start()

    @property
    def url(self) -> str:
        return f"resp://127.0.0.1:{self.port}"

    def arm(self, hook: Callable[[], None], exists: int = 1) -> None:
        """Run ``hook`` once, when the ``exists``-th EXISTS from now has its reply, before relaying it."""
        with self._lock:
            self.fired.clear()
            self.hook_error = None
            self._hook = hook
            self._exists_left = exists

    def disarm(self) -> None:
        with self._lock:
            self._hook = None

    def close(self) -> None:
        """Stop listening and end every relayed connection (as a dead server would)."""
        self._closed = True
        self._listener.close()
        for sock in list(self._sockets):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), name="resp-hook-relay", daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection((self.valkey.host, self.valkey.port))
        except OSError:
            client.close()
            return
        self._sockets += [client, upstream]
        from_client, from_valkey = client.makefile("rb"), upstream.makefile("rb")
        try:
            while True:
                command = read_reply(from_client)
                if not command:
                    return
                upstream.sendall(command)
                reply = read_reply(from_valkey)
                if not reply:
                    return
                name, key = command_words(command)
                with self._lock:
                    self.commands[name] = self.commands.get(name, 0) + 1
                    if len(self.trace) < 100_000:
                        self.trace.append((name, key, _reply_kind(reply)))
                    if name == "EXISTS" and self._hook is not None:
                        self._exists_left -= 1
                    if name == "EXISTS" and self._hook is not None and self._exists_left <= 0:
                        hook, self._hook = self._hook, None
                        self.trace.append(("HOOK", key, b""))
                        try:
                            hook()
                        except BaseException as error:  # reported by the test, not lost in a thread
                            self.hook_error = error
                        self.fired.set()
                client.sendall(reply)
        except (OSError, ConnectionError, ValueError):
            return
        finally:
            client.close()
            upstream.close()
