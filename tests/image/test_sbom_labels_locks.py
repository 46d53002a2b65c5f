"""SBOM generator, provenance labels and lock-file reading."""
from __future__ import annotations

import importlib.metadata as md
import json

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
