"""SBOM generator, provenance labels and lock-file reading."""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
from pathlib import Path

from imagectl import finalize, labels, locks, sbom

from .conftest import REPO

LOCK = """\
# header
torch==2.13.0 \\
    --hash=sha256:60fcdcb2f3876e21146cb4524ef06397d727ca9ad5f020818547e25075fe3cb7  # torch-2.13.0.whl
Jinja2==3.1.6 \\
    --hash=sha256:85ece4451f492d0c13c5dd7c13a64681a86afae63a5f347908daf103ce6d2f67
"""


def test_lock_entries_and_hashes() -> None:
    entries = locks.entries_from_lock(LOCK)
    assert entries["torch"] == ("2.13.0", "60fcdcb2f3876e21146cb4524ef06397d727ca9ad5f020818547e25075fe3cb7")
    assert "jinja2" in entries
    real = locks.entries_from_lock((REPO / "build" / "lock" / "image.txt").read_text())
    assert real["vllm"][0] == "0.31.0" and "lmcache" not in real and "flashinfer-python" not in real
    assert len(real) > 100


def test_wheel_sums() -> None:
    text = "a" * 64 + "  ./lmcache-0.5.5+glm53.abc-cp311-cp311-linux_x86_64.whl\n"
    sums = locks.wheel_sums(text)
    assert sums == {"lmcache-0.5.5+glm53.abc-cp311-cp311-linux_x86_64.whl": "a" * 64}
    assert locks.project_of_wheel("flashinfer_python-0.7.0.post1-py3-none-any.whl") == "flashinfer-python"


def test_sbom_of_this_environment_is_cyclonedx_and_complete() -> None:
    comps = sbom.components(None, {"pytest": "b" * 64})
    # (name, version): once setuptools is imported, its _vendor folder is on
    # sys.path and a few packages are visible in two versions.
    found = {(sbom.normalize(d.metadata["Name"]), d.version) for d in md.distributions() if d.metadata["Name"]}
    assert {c["name"].lower().replace("_", "-") for c in comps} >= {"pytest"}
    assert len(comps) == len(found)
    doc = sbom.document(comps, {"type": "container", "name": "x"})
    assert doc["bomFormat"] == "CycloneDX" and doc["specVersion"] == "1.5"
    pytest_comp = next(c for c in comps if sbom.normalize(c["name"]) == "pytest")
    assert pytest_comp["purl"] == f"pkg:pypi/pytest@{md.version('pytest')}"
    assert pytest_comp["hashes"] == [{"alg": "SHA-256", "content": "b" * 64}]
    assert len({c["bom-ref"] for c in comps}) == len(comps)
    again = sbom.document(sbom.components(None, {"pytest": "b" * 64}), {"type": "container", "name": "x"})
    assert json.dumps(again, sort_keys=True) == json.dumps(doc, sort_keys=True)   # deterministic


def _manifest() -> dict:
    return {"schema": 1, "inputs": [], "outputs": {},
            "upstreams": {u: {"series_sha256": f"{i}" * 64, "patched_tree": f"{i}" * 40, "patches": []}
                          for i, u in enumerate(("flashinfer", "lmcache", "vllm"), 1)}}


def test_labels_from_manifest_and_mismatch_detection() -> None:
    manifest = _manifest()
    args = labels.build_args(manifest, "missing")
    assert args["LMCACHE_PATCHED_TREE"] == "2" * 40 and args["FLASHINFER_AOT"] == "missing"
    assert len(args["PATCH_SERIES_SHA256"]) == 64
    good = {labels.LABEL_OF_ARG[k]: v for k, v in args.items()}
    assert labels.mismatches(good, manifest, "missing") == []
    bad = dict(good, **{"io.glm53.lmcache.patched-tree": "0" * 40})
    assert "io.glm53.lmcache.patched-tree" in labels.mismatches(bad, manifest, "missing")[0]
    manifest["upstreams"]["lmcache"]["series_sha256"] = "f" * 64
    assert labels.series_sha256(manifest) != args["PATCH_SERIES_SHA256"]


def test_every_label_arg_is_declared_and_used_in_the_dockerfile() -> None:
    text = (REPO / "Dockerfile").read_text()
    for arg, label in labels.LABEL_OF_ARG.items():
        assert f"ARG {arg}=" in text and f'{label}="${{{arg}}}"' in text


def test_finalize_adds_outputs_and_keeps_inputs() -> None:
    aot = {"status": "missing", "reason": "unreachable"}
    out = finalize.build_manifest(_manifest(), {"lmcache-0.5.5+glm53.x-cp311-cp311-linux_x86_64.whl": "c" * 64}, aot,
                                  {"vllm": "0.31.0"})
    assert out["outputs"]["wheel:lmcache"]["sha256"] == "c" * 64
    assert out["outputs"]["flashinfer-fused-moe-aot"] == aot
    assert out["upstreams"] == _manifest()["upstreams"] and out["installed"] == {"vllm": "0.31.0"}


STATUS = """Package: libc6
Status: install ok installed
Architecture: amd64
Source: glibc
Version: 2.36-9+deb12u13
Description: GNU C Library
 continuation line: not a field

Package: gone
Status: deinstall ok config-files
Architecture: amd64
Version: 1.0

Package: tini
Status: install ok installed
Architecture: amd64
Version: 0.19.0-1
"""


def test_debian_packages_are_components_with_their_locked_deb_hash() -> None:
    lock = {"libc6": ("2.36-9+deb12u13", "a" * 64), "tini": ("0.19.0-2", "b" * 64)}
    comps = sbom.debian_components(STATUS, lock)
    assert [c["name"] for c in comps] == ["libc6", "tini"]   # the deinstalled one is not in the image
    libc = comps[0]
    assert libc["purl"] == "pkg:deb/debian/libc6@2.36-9+deb12u13?arch=amd64&distro=debian-12"
    assert libc["hashes"] == [{"alg": "SHA-256", "content": "a" * 64}]
    assert libc["properties"] == [{"name": "debian:source", "value": "glibc"}]
    assert "hashes" not in comps[1]   # installed 0.19.0-1, the lock says -2: no hash is claimed


def test_libraries_bundled_in_a_wheel_are_components_its_package_depends_on(tmp_path: Path) -> None:
    libs = tmp_path / "demo.libs"
    libs.mkdir()
    (libs / "libucp-5e0b2a5c.so.0.0.0").write_bytes(b"\x7fELF ucx")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "_ext.so").write_bytes(b"\x7fELF own")   # the package's own extension: not bundled
    info = tmp_path / "demo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
    (info / "RECORD").write_text("demo.libs/libucp-5e0b2a5c.so.0.0.0,,\ndemo/_ext.so,,\ndemo-1.0.dist-info/RECORD,,\n")
    comps, deps = sbom.bundled_libraries([md.PathDistribution(info)])
    assert [(c["name"], c.get("version")) for c in comps] == [("libucp", "0.0.0")]
    assert comps[0]["hashes"][0]["content"] == hashlib.sha256(b"\x7fELF ucx").hexdigest()
    assert deps == {"pkg:pypi/demo@1.0": ["file:demo.libs/libucp-5e0b2a5c.so.0.0.0"]}
    doc = sbom.document(comps, {"type": "container", "name": "x"}, deps)
    assert doc["dependencies"] == [{"ref": "pkg:pypi/demo@1.0",
                                    "dependsOn": ["file:demo.libs/libucp-5e0b2a5c.so.0.0.0"]}]
    assert sbom.count_kinds(doc) == {"pypi": 0, "deb": 0, "bundled": 1, "source": 0}


def test_the_whole_image_sbom_of_this_machine_has_all_three_kinds() -> None:
    status = Path("/var/lib/dpkg/status")
    if not status.is_file():
        import pytest
        pytest.skip("not a dpkg system")
    doc = sbom.image_document({}, status.read_text(),
                              sbom.debian_lock_entries((REPO / "build" / "lock" / "debian.txt").read_text()),
                              {"type": "container", "name": "x"})
    kinds = sbom.count_kinds(doc)
    assert kinds["pypi"] > 10 and kinds["deb"] > 50
    refs = [c["bom-ref"] for c in doc["components"]]
    assert len(refs) == len(set(refs))


def test_each_source_built_library_is_a_component_with_its_pinned_source(tmp_path: Path) -> None:
    """The image builds libfabric and rdma-core from pinned tarballs (the Dockerfile's libfabric
    stage): the SBOM lists each built library by its sha256 and its source by the Dockerfile's pin."""
    import re

    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    copies = {"libfabric": r"COPY --from=libfabric /out/ /opt/libfabric/",
              "rdma-core": r"COPY --from=libfabric /out-rdma/ /opt/rdma-core/"}
    assert [entry["name"] for entry in sbom.SOURCE_BUILT] == ["libfabric", "rdma-core"]
    for entry in sbom.SOURCE_BUILT:
        arg = entry["name"].upper().replace("-", "_")
        assert f"ARG {arg}_VERSION={entry['version']}" in dockerfile
        assert f"ARG {arg}_ORIG_SHA256={entry['source_sha256']}" in dockerfile
        folder = "/opt/" + entry["name"] + "/lib/"
        assert re.search(copies[entry["name"]], dockerfile) and entry["path"].startswith(folder)
    entry = sbom.SOURCE_BUILT[0]
    built = tmp_path / "libfabric.so.1"
    built.write_bytes(b"\x7fELF built")
    (comp,) = sbom.source_built_components(({**entry, "path": str(built)},))
    assert comp["bom-ref"] == "pkg:generic/libfabric@2.1.0" and comp["version"] == "2.1.0"
    assert comp["hashes"] == [{"alg": "SHA-256", "content": hashlib.sha256(b"\x7fELF built").hexdigest()}]
    assert {"name": "glm53:source-sha256", "value": entry["source_sha256"]} in comp["properties"]
    assert sbom.source_built_components(({**entry, "path": str(tmp_path / "absent")},)) == []
    assert sbom.count_kinds(sbom.document([comp], {"type": "container", "name": "x"}))["source"] == 1
