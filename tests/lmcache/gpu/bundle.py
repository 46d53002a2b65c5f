"""The device bundle's layout and manifest: what make_bundle.py writes and what
install_deps.py and test_bundle.py check (stdlib only: it runs on the GPU
machine before anything is installed there).

Layout of work/lmcache-gpu-bundle/:
  lmcache-src.tar.gz   ``git archive`` of the patched tree's HEAD (the paths in SOURCE_PATHS)
  wheels/              the wheels of closure.DISTS with provider "bundle"
  manifest.json        every file with its size and sha256, every dist with its wheels
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
STAMP = "SOURCES.json"  # written over the finished bundle by `make gpu-bundles` (distbuild.host.gpubundles)
SOURCE_ARCHIVE = "lmcache-src.tar.gz"
WHEELS = "wheels"
# What setup.py build_ext and the tests read (LMCache's docs, examples,
# benchmarks and own tests stay behind: 25 MB of 34).
SOURCE_PATHS = ("lmcache", "csrc", "setup_extensions", "setup.py", "pyproject.toml", "requirements",
                "MANIFEST.in", "LICENSE", "README.md")
CARRY_LIMIT = 64 * 1024 * 1024  # the GPU host's limit on the input it is given
# The bundle and the repository's tracked files together stay under this
# share of CARRY_LIMIT, leaving room for what other helpers add to the tree.
BUDGET_SHARE = 0.5


class BundleError(Exception):
    """A bundle that cannot be used, with the file or value at fault."""


@dataclass(frozen=True)
class WheelName:
    name: str
    version: str
    python: str  # e.g. py3, cp312
    abi: str     # none, cp312, abi3
    platform: str  # any, manylinux_2_28_x86_64 (several joined by '.')

    @property
    def tags(self) -> set[str]:
        return {f"{p}-{a}-{pl}" for p in self.python.split(".") for a in self.abi.split(".")
                for pl in self.platform.split(".")}


def parse_wheel_name(filename: str) -> WheelName:
    """PEP 427: name-version(-build)?-python-abi-platform.whl."""
    if not filename.endswith(".whl"):
        raise BundleError(f"{filename}: not a wheel file name")
    parts = filename[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise BundleError(f"{filename}: expected name-version[-build]-python-abi-platform.whl")
    name, version = parts[0], parts[1]
    python, abi, platform = parts[-3:]
    return WheelName(name, version, python, abi, platform)


def normalize(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def wheel_kind(wheel: WheelName) -> str:
    """pure (py3-none-any), native-any (a binary that fits any Python), or native."""
    if wheel.abi == "none" and wheel.platform == "any":
        return "pure"
    if wheel.abi == "none" and all(p.startswith("py") for p in wheel.python.split(".")):
        return "native-any"
    return "native"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_manifest(bundle: Path) -> dict:
    path = bundle / MANIFEST
    if not path.is_file():
        raise BundleError(f"{path}: no manifest (run tests/lmcache/gpu/make_bundle.py)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path}: not JSON: {exc}") from exc


def check_manifest(bundle: Path, manifest: dict, hashes: bool = True) -> list[str]:
    """Every problem with the bundle as the manifest describes it (empty: usable).

    Checks: every listed file is there with its size (and sha256), nothing
    unlisted lies beside them, every wheel belongs to a dist the manifest lists
    as carried, and its kind is the dist's (a native wheel only where the dist
    is declared native), and the total stays under the carry budget together
    with the repository's tracked files.
    """
    problems: list[str] = []
    files: dict[str, dict] = manifest.get("files", {})
    for rel, entry in files.items():
        path = bundle / rel
        if not path.is_file():
            problems.append(f"{rel}: listed in {MANIFEST} but missing")
            continue
        if path.stat().st_size != entry["bytes"]:
            problems.append(f"{rel}: {path.stat().st_size} bytes, {MANIFEST} says {entry['bytes']}")
        elif hashes and sha256(path) != entry["sha256"]:
            problems.append(f"{rel}: sha256 differs from {MANIFEST}")
    present = {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file()} - {MANIFEST, STAMP}
    for rel in sorted(present - set(files)):
        problems.append(f"{rel}: in the bundle but not in {MANIFEST}")
    if SOURCE_ARCHIVE not in files:
        problems.append(f"{SOURCE_ARCHIVE}: missing from {MANIFEST}")
    dists = {normalize(d["name"]): d for d in manifest.get("dists", [])}
    wheel_files = {rel for rel in files if rel.startswith(WHEELS + "/")}
    claimed: set[str] = set()
    for key, dist in dists.items():
        for rel in dist.get("wheels", []):
            claimed.add(rel)
            if rel not in files:
                problems.append(f"{dist['name']}: wheel {rel} not in the files list")
                continue
            wheel = parse_wheel_name(Path(rel).name)
            if normalize(wheel.name) != key or wheel.version != dist["version"]:
                problems.append(f"{rel}: is {wheel.name} {wheel.version}, "
                                f"listed under {dist['name']} {dist['version']}")
            kind = wheel_kind(wheel)
            if kind != dist["kind"]:
                problems.append(f"{rel}: a {kind} wheel, but {dist['name']} is declared {dist['kind']}")
        if dist["provider"] == "bundle" and not dist.get("wheels"):
            problems.append(f"{dist['name']}: provider bundle but no wheel carried")
        if dist["provider"] == "device" and dist.get("wheels"):
            problems.append(f"{dist['name']}: provider device but wheels carried")
    for rel in sorted(wheel_files - claimed):
        problems.append(f"{rel}: a wheel no dist claims")
    total = sum(entry["bytes"] for entry in files.values())
    if total != manifest.get("total_bytes"):
        problems.append(f"total_bytes {manifest.get('total_bytes')} but the files add up to {total}")
    budget = int(CARRY_LIMIT * BUDGET_SHARE)
    tracked = int(manifest.get("repo_tracked_bytes", 0))
    if total + tracked > budget:
        problems.append(f"bundle {total} B + tracked files {tracked} B = {total + tracked} B, over the budget "
                        f"{budget} B ({BUDGET_SHARE:.0%} of the GPU host's {CARRY_LIMIT} B input limit)")
    return problems
