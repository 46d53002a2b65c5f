"""CycloneDX 1.5 SBOM (JSON) of an image: Python, Debian and bundled native components.

``python -m imagectl.sbom [--path SITE_PACKAGES] [--lock LOCK ...] [--dpkg-status F --debian-lock F] [--out FILE]``.
Each Python component is a ``pkg:pypi`` package with its version, licence (from its
metadata) and, when a lock file or a checksum list names it, the sha256 of the
wheel it was installed from. Each installed Debian package is a ``pkg:deb``
component with its version, architecture and, from build/lock/debian.txt, the
sha256 of its .deb. Native libraries a wheel bundles (auditwheel's and
meson-python's ``*.libs`` folders: UCX and libfabric inside nixl-cu13, for
example) are components of their own with the file's sha256, and the wheel's
component depends on them. Output is deterministic: components are sorted
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


DEBIAN_DISTRO = "debian-12"
_LIB_VERSION = re.compile(r"\.so\.(\d+(?:\.\d+)*)$")
_AUDITWHEEL_HASH = re.compile(r"(?:-[0-9a-f]{8})+(?=\.so)")


def dpkg_installed(status_text: str) -> list[dict[str, str]]:
    """Installed packages of a dpkg status file: Package, Version, Architecture, Source."""
    out = []
    for block in status_text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line[:1] in (" ", "\t") or ":" not in line:
                continue
            key, _, value = line.partition(":")
            fields[key] = value.strip()
        if fields.get("Package") and fields.get("Status", "").endswith(" installed"):
            out.append(fields)
    return out


def debian_components(status_text: str, lock: dict[str, tuple[str, str]]) -> list[dict]:
    """``lock``: {package: (version, .deb sha256)} from build/lock/debian.txt (every stage's section)."""
    comps = []
    for pkg in dpkg_installed(status_text):
        name, version, arch = pkg["Package"], pkg.get("Version", ""), pkg.get("Architecture", "")
        purl = f"pkg:deb/debian/{name}@{version}?arch={arch}&distro={DEBIAN_DISTRO}"
        comp: dict = {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl}
        if pkg.get("Source"):
            comp["properties"] = [{"name": "debian:source", "value": pkg["Source"]}]
        locked = lock.get(name)
        if locked and locked[0] == version:
            comp["hashes"] = [{"alg": "SHA-256", "content": locked[1]}]
        comps.append(comp)
    return sorted(comps, key=lambda c: c["bom-ref"])


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def bundled_libraries(dists: list[md.Distribution] | None = None) -> tuple[list[dict], dict[str, list[str]]]:
    """Shared libraries installed inside a ``*.libs`` folder of a wheel (vendored by auditwheel or
    meson-python), one component each; and {dist bom-ref: [their bom-refs]}."""
    comps: dict[str, dict] = {}
    deps: dict[str, list[str]] = {}
    for dist in dists if dists is not None else md.distributions():
        if not dist.metadata or not dist.metadata["Name"]:
            continue
        owner = f"pkg:pypi/{normalize(dist.metadata['Name'])}@{dist.version}"
        for f in dist.files or ():
            parts = f.parts
            if len(parts) < 2 or not any(p.endswith(".libs") for p in parts[:-1]) or ".so" not in f.name:
                continue
            path = Path(f.locate())
            if not path.is_file():
                continue
            rel = "/".join(parts)
            version = _LIB_VERSION.search(f.name)
            base = _AUDITWHEEL_HASH.sub("", f.name).split(".so")[0]
            ref = f"file:{rel}"
            comp = {"type": "library", "bom-ref": ref, "name": base,
                    "hashes": [{"alg": "SHA-256", "content": _file_sha256(path)}],
                    "properties": [{"name": "glm53:bundled-in", "value": owner}, {"name": "glm53:path", "value": rel}]}
            if version:
                comp["version"] = version.group(1)
            comps[ref] = comp
            deps.setdefault(owner, []).append(ref)
    return sorted(comps.values(), key=lambda c: c["bom-ref"]), {k: sorted(v) for k, v in sorted(deps.items())}


# Libraries the image builds from source in a stage of its own (not a wheel, not a .deb): the
# source they were built from, as the Dockerfile pins it (tests/image/test_sbom_labels_locks.py
# keeps the two equal).
SOURCE_BUILT = (
    {"name": "libfabric", "version": "2.1.0", "path": "/opt/libfabric/lib/libfabric.so.1",
     "source": "Debian trixie pool: libfabric_2.1.0.orig.tar.xz",
     "source_sha256": "1a66369772d5bb151737214af1c478993e969cf298e8f9ed369e7a2ab8d8c6df"},
    {"name": "rdma-core", "version": "56.1", "path": "/opt/rdma-core/lib/libibverbs.so.1",
     "source": "Debian trixie pool: rdma-core_56.1.orig.tar.gz",
     "source_sha256": "63ce7f2baa7242c2dbc76375dac957c420187dd27f8c5e148efc07971ee522a8"},
)


def source_built_components(entries: tuple[dict, ...] = SOURCE_BUILT) -> list[dict]:
    """One component per library of SOURCE_BUILT the image has: the built file's sha256, and the
    source it came from (pedigree) with that file's sha256."""
    comps = []
    for entry in entries:
        path = Path(entry["path"])
        if not path.is_file():
            continue
        comps.append({"type": "library", "bom-ref": f"pkg:generic/{entry['name']}@{entry['version']}",
                      "name": entry["name"], "version": entry["version"],
                      "purl": f"pkg:generic/{entry['name']}@{entry['version']}",
                      "hashes": [{"alg": "SHA-256", "content": _file_sha256(path)}],
                      "pedigree": {"notes": f"built in the image from {entry['source']} "
                                            f"(sha256 {entry['source_sha256']})"},
                      "properties": [{"name": "glm53:path", "value": entry["path"]},
                                     {"name": "glm53:source", "value": entry["source"]},
                                     {"name": "glm53:source-sha256", "value": entry["source_sha256"]}]})
    return comps


def document(comps: list[dict], subject: dict, dependencies: dict[str, list[str]] | None = None) -> dict:
    body = json.dumps([comps, dependencies or {}], sort_keys=True).encode()
    serial = uuid.uuid5(uuid.NAMESPACE_URL, "glm53-sbom:" + hashlib.sha256(body).hexdigest())
    doc = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{serial}",
        "version": 1,
        "metadata": {"component": subject, "tools": {"components": [{"type": "application", "name": "imagectl.sbom"}]}},
        "components": comps,
    }
    if dependencies:
        doc["dependencies"] = [{"ref": ref, "dependsOn": on} for ref, on in sorted(dependencies.items())]
    return doc


def image_document(hashes: dict[str, str], status_text: str | None, debian_lock: dict[str, tuple[str, str]],
                   subject: dict) -> dict:
    """The whole image: Python distributions, Debian packages, libraries bundled in wheels."""
    comps = components(None, hashes)
    native, deps = bundled_libraries()
    debs = debian_components(status_text, debian_lock) if status_text else []
    return document(comps + debs + native + source_built_components(), subject, deps)


def count_kinds(doc: dict) -> dict[str, int]:
    refs = [c.get("bom-ref", "") for c in doc.get("components", [])]
    return {"pypi": sum(r.startswith("pkg:pypi/") for r in refs), "deb": sum(r.startswith("pkg:deb/") for r in refs),
            "bundled": sum(r.startswith("file:") for r in refs),
            "source": sum(r.startswith("pkg:generic/") for r in refs)}


def debian_lock_entries(text: str) -> dict[str, tuple[str, str]]:
    """Every stage's {package: (version, sha256)} of build/lock/debian.txt (later stages win)."""
    from .aptpin import parse_lock
    out: dict[str, tuple[str, str]] = {}
    for _top, entries in parse_lock(text).values():
        out.update(entries)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="imagectl.sbom", description=__doc__)
    p.add_argument("--path", action="append", help="site-packages folder (default: this interpreter's)")
    p.add_argument("--lock", action="append", type=Path, default=[], help="lock file with --hash=sha256 lines")
    p.add_argument("--dpkg-status", type=Path, help="also the Debian packages (/var/lib/dpkg/status)")
    p.add_argument("--debian-lock", type=Path, help="build/lock/debian.txt (each .deb's sha256)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from .locks import hashes_from_lock
    sha = {}
    for lock in args.lock:
        sha.update(hashes_from_lock(lock.read_text()))
    subject = {"type": "container", "name": "glm53-b300-serving"}
    if args.dpkg_status:
        deb_lock = debian_lock_entries(args.debian_lock.read_text()) if args.debian_lock else {}
        doc = image_document(sha, args.dpkg_status.read_text(), deb_lock, subject)
    else:
        doc = document(components(args.path, sha), subject)
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
