"""What a pytest run leaves running: engines and Valkey servers its tests started in sessions of
their own, which outlive the run when it is stopped at its bound (SIGKILL skips every fixture's
teardown). Each run carries a token in its environment; every process it starts inherits it, so
after the run whatever still carries the token is the run's and is killed. An engine left behind
keeps its worker pinned to a core: every later engine on that core then starts many times slower.
"""
from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

TOKEN_ENV = "DIST_PYTEST_RUN"
PROC = Path("/proc")


def new_token() -> str:
    return uuid.uuid4().hex


def carrying(token: str, proc: Path = PROC) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose environment holds ``TOKEN_ENV=token``."""
    entry = f"{TOKEN_ENV}={token}".encode()
    found = []
    for folder in proc.glob("[0-9]*"):
        try:
            if entry not in (folder / "environ").read_bytes().split(b"\0"):
                continue
            command = (folder / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:   # gone meanwhile, or not ours to read
            continue
        found.append((int(folder.name), command))
    return sorted(found)


def kill_leftovers(token: str, proc: Path = PROC) -> list[str]:
    """Kill every process still carrying ``token``; describe each one killed."""
    killed = []
    for pid, command in carrying(token, proc):
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.append(f"{pid} {command[:160]}")
    return killed
