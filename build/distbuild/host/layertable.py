"""The image's release layout, its digest, and the layer table (each layer's step and sizes).

The image is written to an OCI layout with the engine's own push (gzip, what
a registry stores and a node pulls), in ``work/image/oci``: that layout is the
release artifact and its manifest digest the image's reproducible digest.
podman 4.3 / buildah 1.28 name each step's intermediate image in the history
comments ("FROM 928999b0f3ce"), and those ids carry the random id of the
build container (the docker format's ``container`` field), so the layout's
history comments say ``FROM <intermediate>`` instead; nothing else changes.
The table reads each layer's compressed size from the layout and its
uncompressed size by decompressing it.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from .engine import Engine
from ..errors import DistBuildError

_ARGS_PREFIX = re.compile(r"^\|\d+ (?:\S+=\S* )*")
_INTERMEDIATE = re.compile(r"^FROM [0-9a-f]{12,64}$")


def step_text(created_by: str, width: int = 96) -> str:
    text = _ARGS_PREFIX.sub("", created_by or "")
    text = text.replace("/bin/sh -c #(nop) ", "").replace("/bin/sh -c ", "RUN ")
    text = re.sub(r"--mount=\S+\s*", "", text)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _blob(layout: Path, digest: str) -> Path:
    algo, _, hexd = digest.partition(":")
    return layout / "blobs" / algo / hexd


def _uncompressed_size(path: Path) -> int:
    total = 0
    with gzip.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            total += len(block)
    return total


def read_layout(layout: Path) -> list[dict]:
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads(_blob(layout, index["manifests"][0]["digest"]).read_text())
    config = json.loads(_blob(layout, manifest["config"]["digest"]).read_text())
    steps = [h.get("created_by", "") for h in config.get("history", []) if not h.get("empty_layer")]
    layers = manifest["layers"]
    if len(steps) != len(layers):
        steps = [""] * len(layers)   # a history that does not map one to one: sizes only
    rows = []
    for n, (layer, step, diff_id) in enumerate(zip(layers, steps, config["rootfs"]["diff_ids"]), 1):
        path = _blob(layout, layer["digest"])
        gz = layer["mediaType"].endswith("gzip")
        rows.append({"layer": n, "step": step_text(step), "compressed": layer["size"],
                     "size": _uncompressed_size(path) if gz else path.stat().st_size, "diff_id": diff_id})
    return rows


def _write_blob(layout: Path, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = _blob(layout, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def normalize_layout(layout: Path) -> str:
    """Rewrite the intermediate-image ids out of the history comments; return the manifest digest."""
    index = json.loads((layout / "index.json").read_text())
    desc = index["manifests"][0]
    manifest_path = _blob(layout, desc["digest"])
    manifest = json.loads(manifest_path.read_text())
    config_path = _blob(layout, manifest["config"]["digest"])
    config = json.loads(config_path.read_text())
    for h in config.get("history", []):
        if _INTERMEDIATE.match(h.get("comment", "")):
            h["comment"] = "FROM <intermediate>"
    data = json.dumps(config, separators=(",", ":"), sort_keys=True).encode()
    manifest["config"] = {**manifest["config"], "digest": _write_blob(layout, data), "size": len(data)}
    mdata = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
    index["manifests"][0] = {**desc, "digest": _write_blob(layout, mdata), "size": len(mdata)}
    (layout / "index.json").write_text(json.dumps(index, separators=(",", ":"), sort_keys=True))
    for old in (config_path, manifest_path):
        if old not in (_blob(layout, manifest["config"]["digest"]), _blob(layout, index["manifests"][0]["digest"])):
            old.unlink(missing_ok=True)
    return index["manifests"][0]["digest"]


def release(engine: Engine, image: str, out: Path, log: Callable[[str], None] = print) -> tuple[str, list[dict]]:
    """The release layout of ``image`` in ``out``: its manifest digest and the layer table."""
    if engine.name not in ("podman", "buildah"):
        raise DistBuildError("the release layout needs podman or buildah (push to an OCI layout)")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"layers   writing {image} as a gzip OCI layout to {out} (what a registry push sends: minutes)")
    done = subprocess.run(["nice", "-n", "19", engine.binary, "push", "--quiet", image, f"oci:{out}:image"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise DistBuildError(f"{engine.name} push {image} oci:{out}: {done.stderr.strip()[-1500:]}")
    digest = normalize_layout(out)
    log(f"image    release digest {digest} (the OCI layout {out}; push it as it is, e.g. "
        f"`podman pull oci:{out}:image && podman push --format oci ...`)")
    (out.parent / "release-digest").write_text(digest + "\n")
    return digest, read_layout(out)


def measure(engine: Engine, image: str, out: Path, log: Callable[[str], None] = print) -> list[dict]:
    if engine.name not in ("podman", "buildah"):
        log("layers   the layer table needs podman or buildah (push to an OCI layout); skipped")
        return []
    return release(engine, image, out, log)[1]


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "layers   (no layer table)"
    lines = [f"{'#':>3} {'size':>10} {'gzip':>10}  step"]
    for r in rows:
        lines.append(f"{r['layer']:>3} {r['size'] / 1e6:>8.1f}MB {r['compressed'] / 1e6:>8.1f}MB  {r['step']}")
    total, comp = sum(r["size"] for r in rows), sum(r["compressed"] for r in rows)
    lines.append(f"{'all':>3} {total / 1e9:>8.2f}GB {comp / 1e9:>8.2f}GB  ({len(rows)} layers)")
    return "\n".join(lines)
