"""CycloneDX 1.5 SBOM (JSON) of the Python packages installed in an environment.

``python -m imagectl.sbom [--path SITE_PACKAGES] [--lock LOCK ...] [--out FILE]``.
Each component is a ``pkg:pypi`` package with its version, licence (from its
metadata) and, when a lock file or a checksum list names it, the sha256 of the
wheel it was installed from. Output is deterministic: components are sorted
and the serial number is derived from the content.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import re
import sys
import uuid
from pathlib import Path


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _license(meta: md.PackageMetadata) -> str | None:
    expr = meta.get("License-Expression")
    if expr:
        return expr.strip()
    text = (meta.get("License") or "").strip()
    if text and len(text) <= 80 and "\n" not in text and text.upper() != "UNKNOWN":
        return text
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    return classifiers[0] if classifiers else None


def component(dist: md.Distribution, sha256: dict[str, str]) -> dict:
    name = dist.metadata["Name"]
    version = dist.version
    purl = f"pkg:pypi/{normalize(name)}@{version}"
    comp: dict = {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl}
    lic = _license(dist.metadata)
    if lic:
        comp["licenses"] = [{"license": {"name": lic}}]
    digest = sha256.get(normalize(name))
    if digest:
        comp["hashes"] = [{"alg": "SHA-256", "content": digest}]
    return comp


def components(paths: list[str] | None, sha256: dict[str, str]) -> list[dict]:
    seen: dict[str, dict] = {}
    for dist in md.distributions(path=paths) if paths else md.distributions():
        if not dist.metadata or not dist.metadata["Name"]:
            continue
        comp = component(dist, sha256)
        seen.setdefault(comp["bom-ref"], comp)
    return sorted(seen.values(), key=lambda c: c["bom-ref"])


def document(comps: list[dict], subject: dict) -> dict:
    body = json.dumps(comps, sort_keys=True).encode()
    serial = uuid.uuid5(uuid.NAMESPACE_URL, "glm53-sbom:" + hashlib.sha256(body).hexdigest())
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{serial}",
        "version": 1,
        "metadata": {"component": subject, "tools": {"components": [{"type": "application", "name": "imagectl.sbom"}]}},
        "components": comps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="imagectl.sbom", description=__doc__)
    p.add_argument("--path", action="append", help="site-packages folder (default: this interpreter's)")
    p.add_argument("--lock", action="append", type=Path, default=[], help="lock file with --hash=sha256 lines")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from .locks import hashes_from_lock
    sha = {}
    for lock in args.lock:
        sha.update(hashes_from_lock(lock.read_text()))
    doc = document(components(args.path, sha), {"type": "container", "name": "glm53-b300-serving"})
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
