"""Where the tool reads inputs and writes outputs.

Inputs live in the repository (``build/pins.toml``, ``patches/``); every output
goes under one work folder (``work/`` by default, ``DIST_WORK`` or ``--work``
to move it). ``DIST_CACHE_DIR``, when set, holds the verified downloads, the
tree-hash-keyed wheels, phase 4's kept results and the kept nvcc outputs
instead, so clean checkouts on one machine share them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Layout:
    repo: Path
    work: Path

    @classmethod
    def default(cls, work: str | os.PathLike[str] | None = None, repo: Path | None = None) -> "Layout":
        repo = repo or REPO_ROOT
        chosen = work or os.environ.get("DIST_WORK") or repo / "work"
        return cls(repo=repo, work=Path(chosen).resolve())

    @property
    def pins_file(self) -> Path:
        return self.repo / "build" / "pins.toml"

    @property
    def patches(self) -> Path:
        return self.repo / "patches"

    @property
    def shared_cache(self) -> Path | None:
        """``DIST_CACHE_DIR``: downloads and wheels kept across clean checkouts (CI)."""
        chosen = os.environ.get("DIST_CACHE_DIR")
        return Path(chosen).resolve() if chosen else None

    @property
    def cache(self) -> Path:
        return self.shared_cache / "downloads" if self.shared_cache else self.work / "cache"

    @property
    def wheels(self) -> Path:
        """Wheels built from git trees, one folder per tree hash (content-addressed)."""
        return self.shared_cache / "wheels" if self.shared_cache else self.work / "wheels"

    @property
    def peer_results(self) -> Path:
        """Phase 4's kept results, by the key of what they depend on (host/peerstore.py)."""
        return self.shared_cache / "peer-results" if self.shared_cache else self.work / "peer-results"

    @property
    def nvcc_outputs(self) -> Path:
        """The outputs of make test's nvcc compiles, by the key of their inputs (tests/flashinfer/nvcc_cache.py)."""
        return self.shared_cache / "nvcc-outputs" if self.shared_cache else self.work / "nvcc-outputs"

    @property
    def src(self) -> Path:
        return self.work / "src"

    @property
    def manifest(self) -> Path:
        return self.work / "manifest.json"

    def series_dir(self, upstream: str) -> Path:
        return self.patches / upstream

    def tree(self, upstream: str) -> Path:
        return self.src / upstream
