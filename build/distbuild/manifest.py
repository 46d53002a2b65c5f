"""``work/manifest.json``: every input, patch, tree hash and output, stable across runs.

No timestamps and sorted keys, so an unchanged build writes a byte-identical
manifest. Later steps (wheels, image) record their outputs with
``record_output``; outputs already recorded are kept when the manifest is
rewritten.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from .errors import DistBuildError
from .pins import Pin
from .prepare import tree_hashes
from .series import Patch

SCHEMA = 1


def series_hash(patches: list[Patch]) -> str:
    """One hash over the ordered patch contents: names the series an image carries."""
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(patch.name.encode() + b"\0" + patch.path.read_bytes() + b"\0")
    return digest.hexdigest()


def build(pins: list[Pin], series: dict[str, list[Patch]], src_root: Path, previous: dict | None) -> dict:
    upstreams = {}
    for pin in pins:
        if pin.upstream is None:
            continue
        patches = series.get(pin.upstream, [])
        entry = {
            "sdist": pin.filename,
            "version": pin.version,
            "series_sha256": series_hash(patches),
            "patches": [
                {
                    "file": p.name,
                    "sha256": p.sha256,
                    "subject": p.subject,
                    "forwarded": p.forwarded,
                }
                for p in patches
            ],
        }
        hashes = tree_hashes(src_root / pin.upstream)
        if hashes is not None:
            entry["pristine_tree"], entry["patched_tree"] = hashes
        upstreams[pin.upstream] = entry
    return {
        "schema": SCHEMA,
        "inputs": [asdict(p) for p in sorted(pins, key=lambda p: p.filename)],
        "upstreams": upstreams,
        "outputs": (previous or {}).get("outputs", {}),
    }


def read(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DistBuildError(f"{path}: not valid JSON ({exc}); delete it and rerun") from None


def write(path: Path, manifest: dict) -> bool:
    """Write if the content changed; True when it did."""
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def record_output(path: Path, name: str, artifact: Path, **extra: str) -> None:
    manifest = read(path)
    if manifest is None:
        raise DistBuildError(f"{path}: no manifest yet; run `make patched` first")
    if not artifact.is_file():
        raise DistBuildError(f"{artifact}: output to record does not exist")
    digest = hashlib.sha256(artifact.read_bytes()).hexdigest()
    manifest.setdefault("outputs", {})[name] = {"file": artifact.name, "sha256": digest, **extra}
    write(path, manifest)
