"""The GPU bundle's bookkeeping, here (not gpu-marked; no network).

The manifest check and the install plan run on bundles and interpreters made
up in tmp_path (wheel files are named as pip names them; their content is not
read by either). The bundle in work/lmcache-gpu-bundle, when one was made, is
checked as it is. The device plugin's vLLM skip is checked on real pytest
collection of the gpu test files, in a subprocess where vLLM is made
unimportable (sys.modules["vllm"] = None, as on the GPU machine, which has no
vLLM).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.lmcache.gpu import bundle as b
from tests.lmcache.gpu import closure, device_plugin, install_deps, make_bundle

REPO = Path(__file__).resolve().parents[3]
MADE = REPO / "work" / "lmcache-gpu-bundle"

PURE = "cachetools-8.0.2-py3-none-any.whl"
NATIVE_312 = "msgspec-0.23.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
ABI3 = "cryptography-50.0.2-cp311-abi3-manylinux_2_34_x86_64.whl"
NINJA = "ninja-1.13.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"


def test_wheel_names_and_kinds():
    assert b.wheel_kind(b.parse_wheel_name(PURE)) == "pure"
    assert b.wheel_kind(b.parse_wheel_name("sortedcontainers-2.4.0-py2.py3-none-any.whl")) == "pure"
    assert b.wheel_kind(b.parse_wheel_name(NINJA)) == "native-any"
    assert b.wheel_kind(b.parse_wheel_name(NATIVE_312)) == "native"
    assert b.wheel_kind(b.parse_wheel_name(ABI3)) == "native"
    assert "cp312-cp312-manylinux_2_17_x86_64" in b.parse_wheel_name(NATIVE_312).tags
    assert "cp311-abi3-manylinux_2_34_x86_64" in b.parse_wheel_name(ABI3).tags
    with pytest.raises(b.BundleError, match="not a wheel"):
        b.parse_wheel_name("cachetools-8.0.2.tar.gz")


def dist(name: str, version: str, kind: str, wheels: list[str], provider: str = "bundle", min_version=None) -> dict:
    return {"name": name, "version": version, "modules": [name], "provider": provider, "kind": kind,
            "via": "test", "min_version": min_version, "wheels": [f"{b.WHEELS}/{w}" for w in wheels]}


def fake_bundle(root: Path, dists: list[dict], tracked: int = 1000) -> tuple[Path, dict]:
    staging = root / "bundle"
    (staging / b.WHEELS).mkdir(parents=True)
    src = root / "src" / "lmcache"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    with tarfile.open(staging / b.SOURCE_ARCHIVE, "w:gz") as tar:
        tar.add(src, arcname="lmcache")
    for d in dists:
        for rel in d["wheels"]:
            (staging / rel).write_bytes(b"PK\x05\x06" + bytes(18) + d["name"].encode())
    manifest = make_bundle.write_manifest(staging, {"head": "0" * 40}, dists, ["3.12", "3.11"], tracked)
    return staging, manifest


GOOD = [dist("cachetools", "8.0.2", "pure", [PURE]), dist("msgspec", "0.23.0", "native", [NATIVE_312]),
        dist("ninja", "1.13.2", "native-any", [NINJA]), dist("numpy", "2.2.6", "native", [], provider="device")]


def test_a_bundle_made_here_passes_its_check(tmp_path):
    staging, manifest = fake_bundle(tmp_path, GOOD)
    assert b.check_manifest(staging, manifest) == []
    assert manifest["total_bytes"] == sum(p.stat().st_size
                                          for p in staging.rglob("*") if p.is_file() and p.name != b.MANIFEST)


def test_a_native_wheel_under_a_pure_declaration_is_refused(tmp_path):
    staging, manifest = fake_bundle(tmp_path, [dist("msgspec", "0.23.0", "pure", [NATIVE_312])])
    assert b.check_manifest(staging, manifest) == [
        f"{b.WHEELS}/{NATIVE_312}: a native wheel, but msgspec is declared pure"]


def test_changed_missing_and_unlisted_files_are_named(tmp_path):
    staging, manifest = fake_bundle(tmp_path, GOOD)
    (staging / b.WHEELS / PURE).write_bytes(b"longer than before, a different wheel")
    (staging / b.WHEELS / NINJA).unlink()
    (staging / "stray.txt").write_text("x")
    problems = b.check_manifest(staging, manifest)
    assert any(p.startswith(f"{b.WHEELS}/{PURE}: ") and "bytes" in p for p in problems), problems
    assert f"{b.WHEELS}/{NINJA}: listed in {b.MANIFEST} but missing" in problems
    assert f"stray.txt: in the bundle but not in {b.MANIFEST}" in problems


def test_a_bundle_over_the_carry_budget_is_refused(tmp_path):
    staging, manifest = fake_bundle(tmp_path, GOOD, tracked=int(b.CARRY_LIMIT * b.BUDGET_SHARE))
    (problem,) = b.check_manifest(staging, manifest)
    assert "over the budget" in problem and str(int(b.CARRY_LIMIT * b.BUDGET_SHARE)) in problem


def test_wheels_without_a_dist_and_dists_without_wheels_are_named(tmp_path):
    staging, manifest = fake_bundle(tmp_path, [dist("cachetools", "8.0.2", "pure", [PURE])])
    manifest["dists"][0]["wheels"] = []
    problems = b.check_manifest(staging, manifest)
    assert problems == ["cachetools: provider bundle but no wheel carried",
                        f"{b.WHEELS}/{PURE}: a wheel no dist claims"]


def env(python: str, tags: list[str], found: dict, too_old: dict | None = None) -> dict:
    return {"python": python, "tags": tags, "found": found, "too_old": too_old or {}}


def test_the_plan_uses_the_machine_copy_and_carries_only_what_is_missing(tmp_path):
    _, manifest = fake_bundle(tmp_path, GOOD)
    tags = ["cp312-cp312-manylinux_2_17_x86_64", "py3-none-manylinux_2_17_x86_64", "py3-none-any"]
    rows, problems = install_deps.plan(manifest, env("3.12.3", tags, {"cachetools": "5.0", "numpy": "2.5.2"}))
    assert problems == []
    assert {r["name"]: (r["source"], r["wheel"]) for r in rows} == {
        "cachetools": ("device", None), "msgspec": ("bundle", f"{b.WHEELS}/{NATIVE_312}"),
        "ninja": ("bundle", f"{b.WHEELS}/{NINJA}"), "numpy": ("device", None)}


def test_the_plan_names_a_python_the_bundle_was_not_made_for(tmp_path):
    _, manifest = fake_bundle(tmp_path, GOOD)
    tags = ["cp313-cp313-manylinux_2_17_x86_64", "py3-none-any", "py3-none-manylinux_2_17_x86_64"]
    _, problems = install_deps.plan(manifest, env("3.13.1", tags, {"numpy": "2.5.2"}))
    (problem,) = problems
    assert problem.startswith("msgspec: none of the carried wheels") and "--pythons 3.13" in problem


def test_the_plan_names_a_missing_device_dist_and_replaces_an_old_one(tmp_path):
    dists = [*GOOD, dist("setuptools", "80.10.2", "pure", ["setuptools-80.10.2-py3-none-any.whl"], min_version="77")]
    _, manifest = fake_bundle(tmp_path, dists)
    tags = ["cp312-cp312-manylinux_2_17_x86_64", "py3-none-any", "py3-none-manylinux_2_17_x86_64"]
    rows, problems = install_deps.plan(manifest, env("3.12.3", tags, {"setuptools": "69.0"}, {"setuptools": "69.0"}))
    assert problems == ["numpy: is missing on this machine and the bundle does not carry it "
                        "(closure.py: provider device; imported by test)"]
    assert {r["name"]: r["source"] for r in rows}["setuptools"] == "bundle"


def test_closure_declarations_are_consistent():
    names = [d.name for d in closure.DISTS]
    assert len(names) == len(set(names))
    for d in closure.DISTS:
        assert d.kind in ("pure", "native", "native-any") and d.provider in ("device", "bundle"), d
        assert d.modules, d


@pytest.mark.skipif(not (MADE / b.MANIFEST).is_file(),
                    reason="no bundle made here (work/venv/bin/python tests/lmcache/gpu/make_bundle.py)")
def test_the_made_bundle():
    manifest = b.load_manifest(MADE)
    assert b.check_manifest(MADE, manifest) == []
    declared = {d.name: (d.provider, d.kind) for d in closure.DISTS}
    assert {d["name"]: (d["provider"], d["kind"]) for d in manifest["dists"]} == declared
    for d in manifest["dists"]:
        if d["provider"] == "bundle" and d["kind"] == "native":
            pythons = {p.replace(".", "") for p in manifest["pythons"]}
            covered = {py for rel in d["wheels"] for tag in b.parse_wheel_name(Path(rel).name).tags
                       for py in pythons if tag.startswith(f"cp{py}-") or (tag.split("-")[1] == "abi3"
                                                                           and int(tag.split("-")[0][2:]) <= int(py))}
            assert covered == pythons, (f"{d['name']}: native wheels for {sorted(covered)}, "
                                        f"bundle made for {sorted(pythons)}")


CAPTURE = """
import json, sys
def pytest_configure(config):
    sys.modules["vllm"] = None  # importlib.util.find_spec("vllm") is None: no vLLM, as on the GPU machine
def pytest_collection_finish(session):
    out = {item.nodeid: [m.kwargs.get("reason") for m in item.iter_markers("skip")] for item in session.items}
    print("CAPTURE " + json.dumps(out))
"""


def collect_gpu_tests(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "capture_plugin.py").write_text(CAPTURE)
    files = sorted(device_plugin.NEEDS_VLLM) + ["tests/lmcache/test_0010_pcp_shard_gpu_load.py"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "capture_plugin", "-p",
         "tests.lmcache.gpu.device_plugin", *extra, "-m", "gpu", "--collect-only", "-q", *files],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])})


def test_the_device_plugin_skips_the_vllm_tests_and_only_them(tmp_path):
    result = collect_gpu_tests(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = [printed for printed in result.stdout.splitlines() if printed.startswith("CAPTURE ")]
    reasons = json.loads(line[len("CAPTURE "):])
    vllm = device_plugin.SKIP_REASON.format(device_plugin.NEEDS_VLLM["tests/lmcache/test_glm5_kv_roundtrip.py"])
    glm5 = [n for n in reasons if n.startswith("tests/lmcache/test_glm5_kv_roundtrip.py")]
    assert len(glm5) == 2 and all(vllm in reasons[n] for n in glm5), reasons
    sharded = [n for n in reasons if n.startswith("tests/lmcache/test_0010_pcp_shard_gpu_load.py")]
    # one per paged connector, V2 and V3
    assert len(sharded) == 2 and all(vllm not in reasons[n] for n in sharded), reasons


@pytest.mark.skipif(device_plugin.torch_cuda_available(),
                    reason="a CUDA GPU is here: nothing is skipped for want of one")
def test_device_require_gpu_turns_a_cuda_skip_into_an_error(tmp_path):
    result = collect_gpu_tests(tmp_path, "--device-require-gpu")
    assert result.returncode == 4, result.stdout[-1000:] + result.stderr[-1000:]
    assert "--device-require-gpu: 4 gpu tests would be skipped for want of CUDA" in result.stderr + result.stdout
