"""The container engine ``make image`` drives: docker, podman or buildah, whichever works.

``find_engine`` probes each in that order and returns the first that answers
(a docker client without a reachable daemon does not count). On a Debian
machine with none of them, running as root, ``install_engine`` installs
podman, buildah and runc from the configured apt sources and writes a
``containers.conf`` with the two settings its build hosts need
(docs/building.md): the ``runc`` runtime (``crun`` fails on hybrid cgroups)
and container ulimits ``nofile=1024:1024``, ``nproc=4096:4096``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import DistBuildError

CONTAINERS_CONF = Path("/etc/containers/containers.conf")
CONF_MARKER = "# written by distbuild (make image)"
CONF_TEXT = f"""{CONF_MARKER}: measured settings, see docs/building.md
[containers]
default_ulimits = [
  "nofile=1024:1024",
  "nproc=4096:4096",
]

[engine]
runtime = "runc"
"""
APT_PACKAGES = ("podman", "buildah", "runc", "uidmap", "fuse-overlayfs")


@dataclass(frozen=True)
class Engine:
    """One usable engine; ``name`` is docker, podman or buildah."""

    name: str
    binary: str

    @property
    def can_run(self) -> bool:
        return self.name in ("docker", "podman")

    def build_cmd(self, context: Path, dockerfile: Path, target: str, tag: str,
                  build_args: dict[str, str], secrets: dict[str, Path] | None = None) -> list[str]:
        args = [f"--build-arg={k}={v}" for k, v in sorted(build_args.items())]
        args += [f"--secret=id={k},src={v}" for k, v in sorted((secrets or {}).items())]
        if self.name == "buildah":
            head = [self.binary, "bud", "--layers", "--format=docker", "--network=host"]
        elif self.name == "podman":   # docker format: OCI image configs drop SHELL, which the stages rely on
            head = [self.binary, "build", "--layers", "--format=docker", "--network=host"]
        else:
            head = [self.binary, "build", "--network=host"]
        return [*head, "-f", str(dockerfile), "--target", target, "-t", tag, *args, str(context)]


Probe = Callable[[list[str]], bool]


def _answers(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_engine(preferred: str | None = None, probe: Probe = _answers,
                which: Callable[[str], str | None] = shutil.which) -> Engine | None:
    """The first working engine (``preferred`` only, when given)."""
    checks = {"docker": ["info"], "podman": ["info"], "buildah": ["info"]}
    names = [preferred] if preferred else list(checks)
    for name in names:
        if name not in checks:
            raise DistBuildError(f"ENGINE={name}: expected docker, podman or buildah")
        binary = which(name)
        if binary and probe([binary, *checks[name]]):
            return Engine(name, binary)
    return None


def is_debian(os_release: Path = Path("/etc/os-release")) -> bool:
    try:
        text = os_release.read_text()
    except OSError:
        return False
    return any(line in ("ID=debian", 'ID="debian"') or line.startswith("ID_LIKE=") and "debian" in line
               for line in text.splitlines())


def write_containers_conf(path: Path = CONTAINERS_CONF, log: Callable[[str], None] = print) -> bool:
    """Write our containers.conf unless the admin has their own; True when written."""
    if path.is_file() and CONF_MARKER not in path.read_text():
        log(f"engine   keeping the existing {path} (not ours); "
            "it needs runtime=runc and the ulimits of docs/building.md")
        return False
    if path.is_file() and path.read_text() == CONF_TEXT:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CONF_TEXT)
    log(f"engine   wrote {path}: runtime runc, ulimits nofile=1024:1024 nproc=4096:4096")
    return True


def install_engine(log: Callable[[str], None] = print,
                   run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Engine:
    """apt-get install podman + buildah + runc, then configure them (root, Debian only)."""
    if not is_debian():
        raise DistBuildError("no working container engine (docker, podman or buildah) and this is not Debian: "
                             "install one of them, then rerun `make image`")
    if os.geteuid() != 0:
        raise DistBuildError("no working container engine; installing podman/buildah needs root: "
                             f"run `sudo apt-get install {' '.join(APT_PACKAGES)}` or `make image` as root")
    log(f"engine   no working docker, podman or buildah here: installing {' '.join(APT_PACKAGES)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES]):
        result = run(cmd, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise DistBuildError(f"`{' '.join(cmd)}` failed:\n{(result.stderr or result.stdout)[-2000:]}")
    write_containers_conf(log=log)
    engine = find_engine("podman") or find_engine("buildah")
    if engine is None:
        raise DistBuildError("podman and buildah were installed but neither answers `info`; see `podman info`")
    log(f"engine   installed; using {engine.name} ({engine.binary})")
    return engine


def ensure_engine(preferred: str | None = None, log: Callable[[str], None] = print) -> Engine:
    engine = find_engine(preferred)
    if engine is not None:
        if engine.name in ("podman", "buildah") and CONTAINERS_CONF.parent.is_dir() and os.geteuid() == 0:
            write_containers_conf(log=log)
        log(f"engine   using {engine.name} ({engine.binary})")
        return engine
    if preferred:
        raise DistBuildError(f"ENGINE={preferred}: `{preferred} info` does not answer")
    return install_engine(log)
