"""Version locks of make test's two venvs: ``build/lock/test-venv.txt`` and ``build/lock/test-engine.txt``.

Without them every clean checkout resolves the test venv (``work/venv``) and the
engine venv (``work/venv-engine``) anew against the live index: a release of
any unpinned dependency (huggingface-hub, typer) changes what the suite runs
on, and it changes the inputs of phase 4's kept results, so that phase runs
whole again. Each lock is a pip constraints file of every distribution the
venv holds (``name==version``, local labels such as ``+cpu`` dropped, so the
configured index and find-links still pick the build), headed by the hash of
the requirements it was made from. A venv is made with its lock as pip's
constraints; a lock made from other requirements is refused with the command
that remakes it (``make lock-test``), which builds both venvs unlocked in a
folder of their own and freezes them.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import DistBuildError
from ..paths import REPO_ROOT

LOCK_DIR = REPO_ROOT / "build" / "lock"
VENV_LOCK = LOCK_DIR / "test-venv.txt"
ENGINE_LOCK = LOCK_DIR / "test-engine.txt"
REMAKE = "make lock-test"
INPUTS = re.compile(r"^# inputs: (?P<hash>[0-9a-f]{16})$", re.MULTILINE)
PIN = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._-]*)==(?P<version>[^\s+;]+)$")
# Installed from files the tool builds or fetches itself (the LMCache wheels, the
# pinned vLLM wheel, NIXL's), or pip itself: never constrained by version.
NOT_LOCKED = frozenset({"lmcache", "vllm", "nixl-cu13", "pip"})


@dataclass(frozen=True)
class Lock:
    path: Path
    inputs: str
    pins: tuple[str, ...]   # name==version

    def constraints(self) -> str:
        return "".join(f"{pin}\n" for pin in self.pins)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read(path: Path) -> Lock:
    try:
        text = path.read_text()
    except OSError as exc:
        raise DistBuildError(f"{path}: cannot read the test lock: {exc}; make it with `{REMAKE}`") from exc
    found = INPUTS.search(text)
    if found is None:
        raise DistBuildError(f"{path}: no '# inputs: <hash>' line; remake it with `{REMAKE}`")
    pins = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        if PIN.match(line) is None:
            raise DistBuildError(f"{path}:{number}: {line!r} is not a name==version pin; remake it with `{REMAKE}`")
        pins.append(line)
    return Lock(path, found["hash"], tuple(pins))


def checked(path: Path, inputs: str, what: str) -> Lock:
    """The lock at ``path``, refused unless it was made from the requirements whose hash is ``inputs``."""
    lock = read(path)
    if lock.inputs != inputs:
        raise DistBuildError(f"{path}: made from other requirements than {what} has now (inputs {lock.inputs}, "
                             f"now {inputs}); remake it with `{REMAKE}` and commit it")
    return lock


def frozen(python: Path) -> tuple[str, ...]:
    """What the venv of ``python`` holds, as sorted name==version pins (see ``NOT_LOCKED``)."""
    done = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise DistBuildError(f"{python}: pip list failed: {done.stderr.strip()[-300:]}")
    pins = {}
    for line in done.stdout.splitlines():
        name, sep, version = line.partition("==")
        if not sep or _normalize(name) in NOT_LOCKED:
            continue
        pins[_normalize(name)] = version.split("+", 1)[0]
    return tuple(f"{name}=={version}" for name, version in sorted(pins.items()))


def render(title: str, inputs: str, pins: tuple[str, ...]) -> str:
    return "\n".join([f"# {title}",
                      f"# Written by `{REMAKE}` (python -m distbuild lock --test): never edit by hand.",
                      "# pip constraints; local labels (+cpu) dropped: the index and find-links pick the build.",
                      f"# inputs: {inputs}", *pins]) + "\n"


def write(path: Path, title: str, inputs: str, pins: tuple[str, ...]) -> Path:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(render(title, inputs, pins))
    os.replace(partial, path)
    return path
