"""Last build step of the runtime stage: the image's manifest.json and SBOM.

Takes the manifest the sources stage wrote (``trees/manifest.json``: every
input by hash, each series and its patches, the pristine and patched tree
hashes) and adds this image's outputs: our wheels with their sha256, the
FlashInfer fused-MoE AOT status, and the version of every pinned package as
installed. Then writes the CycloneDX SBOM of the whole image: the venv's
Python distributions, the Debian packages (with build/lock/debian.txt's .deb
sha256) and the native libraries bundled inside wheels.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys
from pathlib import Path

from . import sbom
from .locks import hashes_from_lock, project_of_wheel, wheel_sums

PINNED = ("vllm", "torch", "nixl-cu13", "lmcache", "flashinfer-python")


def build_manifest(sources_manifest: dict, wheels: dict[str, str], aot: dict, installed: dict[str, str]) -> dict:
    manifest = dict(sources_manifest)
    outputs = dict(manifest.get("outputs", {}))
    for filename, sha in sorted(wheels.items()):
        outputs[f"wheel:{project_of_wheel(filename)}"] = {"file": filename, "sha256": sha}
    outputs["flashinfer-fused-moe-aot"] = aot
    manifest["outputs"] = outputs
    manifest["installed"] = installed
    return manifest


def installed_versions(names: tuple[str, ...] = PINNED) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="imagectl.finalize", description=__doc__)
    p.add_argument("--trees", type=Path, required=True)
    p.add_argument("--wheels", type=Path, required=True, help="folder with SHA256SUMS of our wheels")
    p.add_argument("--aot", type=Path, required=True)
    p.add_argument("--lock", type=Path, default=Path("/opt/glm53/lock/image.txt"))
    p.add_argument("--dpkg-status", type=Path, default=Path("/var/lib/dpkg/status"))
    p.add_argument("--debian-lock", type=Path, default=Path("/opt/glm53/lock/debian.txt"))
    p.add_argument("--manifest", type=Path, required=True)
    p.add_argument("--sbom", type=Path, required=True)
    args = p.parse_args(argv)
    sums = wheel_sums((args.wheels / "SHA256SUMS").read_text())
    manifest = build_manifest(json.loads((args.trees / "manifest.json").read_text()), sums,
                              json.loads(args.aot.read_text()), installed_versions())
    args.manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    hashes = hashes_from_lock(args.lock.read_text()) if args.lock.is_file() else {}
    hashes.update({project_of_wheel(f): sha for f, sha in sums.items()})
    status = args.dpkg_status.read_text() if args.dpkg_status.is_file() else None
    deb_lock = sbom.debian_lock_entries(args.debian_lock.read_text()) if args.debian_lock.is_file() else {}
    doc = sbom.image_document(hashes, status, deb_lock, {"type": "container", "name": "glm53-b300-serving"})
    args.sbom.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    kinds = sbom.count_kinds(doc)
    print(f"finalize wrote {args.manifest} and {args.sbom} ({len(doc['components'])} components: "
          f"{kinds['pypi']} Python, {kinds['deb']} Debian, {kinds['bundled']} bundled native libraries, "
          f"{kinds['source']} built from source)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
