"""The CUDA 13.0 compiler from the pinned PyPI wheels, installed into ``work/toolchain``.

The same wheels serve CI (compile checks for ``sm_103a``) and the image's
builder stage, so every compile uses one pinned ``nvcc``. Returns the CUDA
root (``.../site-packages/nvidia/cu13``) to use as ``CUDA_HOME``.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

from .errors import DistBuildError
from .fetch import fetch
from .index import IndexClient
from .pins import Pin

STAMP = "dist-toolchain"


def cuda_home(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages/nvidia/cu13"))
    if not found:
        raise DistBuildError(f"{venv}: no nvidia/cu13 tree; the toolchain wheels are not installed")
    return found[0]


def ensure_toolchain(pins: list[Pin], cache: Path, venv: Path, client_factory: Callable[[], IndexClient]) -> Path:
    wheels = [p for p in pins if p.role == "toolchain"]
    if not wheels:
        raise DistBuildError("the lock file pins no toolchain wheels (role = toolchain)")
    wanted = "\n".join(sorted(p.sha256 for p in wheels))
    stamp = venv / STAMP
    if stamp.is_file() and stamp.read_text() == wanted:
        return cuda_home(venv)
    files = [fetch(p, cache, client_factory) for p in wheels]
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", "--progress-bar", "off",
         *map(str, files)],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise DistBuildError(f"installing the toolchain wheels into {venv} failed:\n{result.stderr[-2000:]}")
    home = cuda_home(venv)
    nvcc = home / "bin" / "nvcc"
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True)
    if version.returncode != 0 or "release 13.0" not in version.stdout:
        raise DistBuildError(f"{nvcc}: not a working CUDA 13.0 nvcc: {version.stdout or version.stderr}")
    stamp.write_text(wanted)
    return home
