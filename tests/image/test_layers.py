"""The runtime's pip layers (image/imagectl/layers.py): the lock split into groups, and bytecode
that is the same for the same sources."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from imagectl import layers

from .conftest import REPO

LOCK = REPO / "build" / "lock" / "image.txt"


def test_every_locked_distribution_lands_in_exactly_one_group_with_its_hashes() -> None:
    text = LOCK.read_text()
    groups = layers.split(text)
    assert set(groups) == set(layers.GROUPS)
    every = [n for g in groups.values() for n in layers.names(g)]
    assert sorted(every) == sorted(layers.names(text)) and len(every) == len(set(every))
    assert all(layers.names(g) for g in groups.values())
    by = {layers.normalize(n): g for g, t in groups.items() for n in layers.names(t)}
    assert by["torch"] == "torch" and by["triton"] == "torch"
    assert by["nvidia-cublas"] == "nvidia" and by["cuda-bindings"] == "nvidia" and by["nvidia-cuda-nvcc"] == "nvidia"
    assert by["vllm"] == "vllm" and by["numpy"] == "rest"
    # each requirement keeps its --hash lines (pip --require-hashes refuses one without)
    hashes = sum(line.strip().startswith("--hash=sha256:") for g in groups.values() for line in g.splitlines())
    assert hashes == sum(line.strip().startswith("--hash=sha256:") for line in text.splitlines()) > len(every) - 1


def _fake_dist(site: Path, name: str, source: str) -> Path:
    pkg = site / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(source)
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text(f"{name}/__init__.py,,\n{name}-1.0.dist-info/METADATA,,\n"
                                 f"{name}-1.0.dist-info/RECORD,,\n")
    return pkg / "__pycache__" / f"__init__.cpython-{sys.version_info[0]}{sys.version_info[1]}.pyc"


def _compile(site: Path, seed: str = "0") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO / 'image'}", PYTHONHASHSEED=seed,
               PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "imagectl.layers", "compile", "demo"], capture_output=True, text=True,
                          env=env)


def test_bytecode_is_unchecked_hash_and_equal_across_builds_with_other_mtimes(tmp_path: Path) -> None:
    source = "VALUES = frozenset({'a', 'b', 'c', 'd', 'e', 'f'})\n"
    pycs = []
    for mtime in (1_000_000_000, 1_700_000_000):
        site = tmp_path / "site"   # the same path (a .pyc records its source's path), another build
        shutil.rmtree(site, ignore_errors=True)
        pyc = _fake_dist(site, "demo", source)
        os.utime(site / "demo" / "__init__.py", (mtime, mtime))
        done = _compile(site)
        assert done.returncode == 0, done.stderr
        assert "1 .pyc (unchecked-hash)" in done.stdout
        pycs.append(pyc.read_bytes())
    assert pycs[0] == pycs[1]
    flags = int.from_bytes(pycs[0][4:8], "little")
    assert flags == 0b01   # hash-based, unchecked: the import system never looks at the source's mtime


def test_compile_refuses_a_random_hash_seed(tmp_path: Path) -> None:
    site = tmp_path / "site"
    pyc = _fake_dist(site, "demo", "X = {1, 2}\n")
    done = _compile(site, seed="random")
    assert done.returncode != 0 and "PYTHONHASHSEED=0" in done.stderr
    assert not pyc.exists()
