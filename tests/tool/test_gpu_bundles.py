"""The GPU bundles' stamps (build/distbuild/host/gpubundles.py): a bundle says which series it was
made from, and a GPU run refuses one that is not the carried tree's or that changed since.

The repositories here are small real git trees with a real series folder; the device script
test runs tests/flashinfer/gpu/device_run.sh itself, which stops at the stamp before any GPU
work."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from distbuild.errors import DistBuildError
from distbuild.host import gpubundles

REPO = Path(__file__).resolve().parents[2]
PATCH = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
Subject: [PATCH] a change

---
"""


def _repo(tmp_path: Path) -> tuple[Path, Path]:
    """A checkout with patches/lmcache (one patch) and work/src/lmcache, a git tree."""
    repo = tmp_path / "repo"
    series = repo / "patches" / "lmcache"
    series.mkdir(parents=True)
    (series / "0001-a-change.patch").write_text(PATCH)
    (series / "series").write_text("0001-a-change.patch\n")
    tree = repo / "work" / "src" / "lmcache"
    tree.mkdir(parents=True)
    (tree / "setup.py").write_text("print('lmcache')\n")
    for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(tree), *cmd], check=True)
    return repo, repo / "work"


def _bundle(work: Path) -> Path:
    bundle = work / gpubundles.LMCACHE_BUNDLE
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "lmcache-src.tar.gz").write_bytes(b"archive")
    (bundle / "wheels" / "x-1-py3-none-any.whl").write_bytes(b"wheel")
    return bundle


def test_a_fresh_stamp_passes_and_says_what_the_bundle_holds(tmp_path):
    repo, work = _repo(tmp_path)
    bundle = _bundle(work)
    record = gpubundles.stamp(bundle, repo, work, {"lmcache": "0.5.5"})
    lines = gpubundles.check(bundle, repo)
    assert record["series"]["lmcache"]["series_sha256"] == gpubundles.carried_series(repo, "lmcache")
    assert any("lmcache 0.5.5: series" in line for line in lines)
    assert any(line.strip().startswith("lmcache-src.tar.gz: sha256") for line in lines)
    assert lines[-1].strip().startswith("matches the carried series")


def test_a_bundle_of_another_series_is_refused(tmp_path):
    repo, work = _repo(tmp_path)
    bundle = _bundle(work)
    gpubundles.stamp(bundle, repo, work, {"lmcache": "0.5.5"})
    (repo / "patches" / "lmcache" / "0001-a-change.patch").write_text(PATCH + "+one more line\n")
    with pytest.raises(gpubundles.StaleBundle, match=r"made from lmcache series .* is series .*stale bundle"):
        gpubundles.check(bundle, repo)


def test_a_bundle_of_other_patch_parts_is_refused(tmp_path):
    """A leave-out variant removes a part of a patch (tests/parts/): an edited part is another
    variant, so a bundle carrying the old one is stale too."""
    repo, work = _repo(tmp_path)
    parts = repo / "tests" / "parts" / "lmcache"
    parts.mkdir(parents=True)
    (parts / "0001-a-change.stream-order.diff").write_text("--- a\n+++ b\n")
    bundle = _bundle(work)
    gpubundles.stamp(bundle, repo, work, {"lmcache": "0.5.5"})
    gpubundles.check(bundle, repo)
    (parts / "0001-a-change.stream-order.diff").write_text("--- a\n+++ b\n@@ another @@\n")
    with pytest.raises(gpubundles.StaleBundle, match="other lmcache patch parts"):
        gpubundles.check(bundle, repo)


def test_a_bundle_changed_after_its_stamp_is_refused(tmp_path):
    repo, work = _repo(tmp_path)
    bundle = _bundle(work)
    gpubundles.stamp(bundle, repo, work, {"lmcache": "0.5.5"})
    (bundle / "lmcache-src.tar.gz").write_bytes(b"another archive")
    with pytest.raises(gpubundles.StaleBundle, match="its files changed after it was made"):
        gpubundles.check(bundle, repo)


def test_an_unstamped_or_missing_bundle_is_refused_naming_the_command(tmp_path):
    repo, work = _repo(tmp_path)
    with pytest.raises(gpubundles.StaleBundle, match="no bundle at .*make gpu-bundles"):
        gpubundles.check(work / "absent", repo)
    with pytest.raises(gpubundles.StaleBundle, match="no SOURCES.json.*make gpu-bundles"):
        gpubundles.check(_bundle(work), repo)


def test_the_activation_script_refuses_a_stale_bundle_before_any_gpu_work(tmp_path):
    """A bundle stamped for another flashinfer series: the script prints why, exits 2 and leaves
    the log in $OUT, without reaching the build (which would need nvcc and a GPU)."""
    bundle = tmp_path / gpubundles.ACTIVATION_BUNDLE
    (bundle / "patched").mkdir(parents=True)
    (bundle / "patched" / "kernel.cu").write_text("old kernel\n")
    stale = {"bundle": bundle.name, "made_at": "2026-01-01T00:00:00Z", "files": {},
             "series": {"flashinfer": {"version": "0.7.0.post1", "series_sha256": "0" * 64, "patched_tree": "0" * 40}},
             "content_sha256": gpubundles.content_sha256(bundle)}
    (bundle / gpubundles.STAMP).write_text(json.dumps(stale))
    out = tmp_path / "out"
    done = subprocess.run([str(REPO / "tests/flashinfer/gpu/device_run.sh"), str(bundle)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "OUT": str(out), "BUILD_DIR": str(tmp_path / "b")})
    assert done.returncode == 2, done.stdout + done.stderr
    log = (out / "activation.log").read_text()
    assert "REFUSED" in log and "stale bundle" in log and "make gpu-bundles" in log
    assert not list((tmp_path / "b").iterdir())  # nothing built


def test_an_activation_bundle_from_another_release_is_stamped_with_its_tree_and_version(tmp_path):
    """make forward BUNDLE=1: the bundle names the newer release and that tree, and passes the check."""
    repo = tmp_path / "repo"
    (repo / "patches" / "flashinfer").mkdir(parents=True)
    (repo / "patches" / "flashinfer" / "0001-a-change.patch").write_text(PATCH)
    (repo / "patches" / "flashinfer" / "series").write_text("0001-a-change.patch\n")
    tree = tmp_path / "forward" / "flashinfer-0.7.4" / "tree"
    tree.mkdir(parents=True)
    (tree / "setup.py").write_text("print('flashinfer')\n")
    for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(tree), *cmd], check=True)
    bundle = tree.parent / gpubundles.ACTIVATION_BUNDLE
    for rel in gpubundles.NAMED_FILES[gpubundles.ACTIVATION_BUNDLE]:
        (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
        (bundle / rel).write_text(f"{rel}\n")
    record = gpubundles.stamp(bundle, repo, None, {"flashinfer": "0.7.4"}, {"flashinfer": tree})
    made = record["series"]["flashinfer"]
    assert made["version"] == "0.7.4"
    assert made["patched_tree"] == subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD^{tree}"],
                                                  capture_output=True, text=True).stdout.strip()
    assert f"flashinfer 0.7.4: series {made['series_sha256'][:16]}" in "\n".join(gpubundles.check(bundle, repo))
    with pytest.raises(DistBuildError, match="must be named activation-bundle"):
        gpubundles.make_activation(repo, tree, "0.7.4", tmp_path, tmp_path / "elsewhere")
