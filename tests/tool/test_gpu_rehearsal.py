"""The GPU call's rehearsal (build/distbuild/host/rehearsal.py): its checks read the call's output
and $OUT the way the GPU host hands them back. The rehearsal itself (`make gpu-rehearsal`:
bundles, a torch venv, the call) takes minutes and runs by hand."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from distbuild.host import gpubundles, rehearsal

LIMITS = ("=== limits: total 540 s; activation 300 s (steps within 290); lmcache 535 s (steps within 525); "
          "grace 10 s\n")


def _checks(step, *args) -> list[tuple[str, bool, str]]:
    report = rehearsal.Report()
    step(*args, report)
    return report.checks


def test_the_default_limits_fit_the_call_and_a_tight_outer_limit_does_not():
    output = LIMITS + "run.py: up to 270 s of the deadline's 290 s\n"
    [(_, ok, detail)] = _checks(rehearsal.check_limits, output, 600)
    assert ok, detail
    [(_, ok, detail)] = _checks(rehearsal.check_limits, output, 560)
    assert not ok and "at worst 575 s of the outer 560 s" in detail


def test_a_run_py_limit_past_its_parts_deadline_fails_the_limits():
    [(_, ok, _)] = _checks(rehearsal.check_limits, LIMITS + "run.py: up to 295 s of the deadline's 290 s\n", 600)
    assert not ok


def test_a_call_without_its_limits_line_fails_naming_it():
    [(_, ok, detail)] = _checks(rehearsal.check_limits, "=== activation: up to 300 s\n", 600)
    assert not ok and "no '=== limits' line" in detail


def test_out_may_hold_eight_files_and_nothing_deeper(tmp_path):
    for i in range(8):
        (tmp_path / f"f{i}").write_text("x")
    [(_, ok, _)] = _checks(rehearsal.check_out, tmp_path)
    assert ok
    (tmp_path / "sub").mkdir()
    [(_, ok, detail)] = _checks(rehearsal.check_out, tmp_path)
    assert not ok and "not plain files at the top: sub" in detail
    (tmp_path / "sub").rmdir()
    (tmp_path / "f8").write_text("x")
    [(_, ok, detail)] = _checks(rehearsal.check_out, tmp_path)
    assert not ok and "9 files (at most 8)" in detail


def test_parts_pass_only_with_their_no_cuda_verdicts(tmp_path):
    (tmp_path / "device-run.tsv").write_text("activation\t3\t2\nlmcache\t200\t0\n")
    (tmp_path / "activation.json").write_text(json.dumps({"stage": "unfit", "verdict": "unfit: no CUDA device: x"}))
    steps = [{"step": s, "seconds": 1, "rc": 0} for s in ("stamp", "detect", "deps", "build", "test")]
    (tmp_path / "lmcache-gpu.json").write_text(json.dumps({"verdict": "rehearsal without CUDA (...)", "steps": steps}))
    assert all(ok for _, ok, _ in _checks(rehearsal.check_parts, tmp_path))
    steps[2]["rc"] = 2
    (tmp_path / "lmcache-gpu.json").write_text(json.dumps({"verdict": "unfit: deps", "steps": steps}))
    (tmp_path / "activation.json").unlink()
    (activation, ok_a, detail_a), (_, ok_l, detail_l) = _checks(rehearsal.check_parts, tmp_path)
    assert not ok_a and "activation.json missing" in detail_a
    assert not ok_l and "failed: deps (rc 2)" in detail_l


def _stamped(tmp_path: Path) -> tuple[Path, Path]:
    """A tree with one patch per upstream and both bundles stamped for it."""
    tree, rwork = tmp_path / "tree", tmp_path / "rwork"
    for upstream in ("flashinfer", "lmcache"):
        series = tree / "patches" / upstream
        series.mkdir(parents=True)
        (series / "0001-a.patch").write_text("From 0 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] a\n\n---\n")
        (series / "series").write_text("0001-a.patch\n")
        src = rwork / "src" / upstream
        src.mkdir(parents=True)
        (src / "f").write_text(upstream)
        for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
            subprocess.run(["git", "-C", str(src), *cmd], check=True)
    for name in rehearsal.BUNDLES:
        bundle = rwork / name
        for rel in gpubundles.NAMED_FILES[name]:
            (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
            (bundle / rel).write_text(rel)
        gpubundles.stamp(bundle, tree, rwork, {"flashinfer": "1", "lmcache": "1"})
    return tree, rwork


def test_stamps_pass_when_printed_before_the_parts_and_fail_after_them(tmp_path):
    tree, rwork = _stamped(tmp_path)
    lines = [line for name in rehearsal.BUNDLES for line in gpubundles.check(rwork / name, tree)]
    printed = "=== bundles\n" + "\n".join(lines) + "\n"
    first = LIMITS + printed + "=== lmcache: up to 535 s\n=== activation: up to 300 s\n"
    assert all(ok for _, ok, _ in _checks(rehearsal.check_stamps, first, tree, rwork))
    late = LIMITS + "=== activation: up to 300 s\n" + printed
    assert not any(ok for _, ok, _ in _checks(rehearsal.check_stamps, late, tree, rwork))


def test_a_bundle_of_another_series_fails_its_stamp_check(tmp_path):
    tree, rwork = _stamped(tmp_path)
    lines = [line for name in rehearsal.BUNDLES for line in gpubundles.check(rwork / name, tree)]
    patch = tree / "patches" / "lmcache" / "0001-a.patch"
    patch.write_text(patch.read_text() + "+another line\n")
    output = "=== bundles\n" + "\n".join(lines) + "\n=== activation: up to 300 s\n"
    by_name = {name: ok for name, ok, _ in _checks(rehearsal.check_stamps, output, tree, rwork)}
    assert by_name == {"stamp activation-bundle": True, "stamp lmcache-gpu-bundle": False}


def test_the_call_carries_tracked_and_untracked_files_but_not_ignored_ones(tmp_path):
    repo = tmp_path / "repo"
    (repo / "work").mkdir(parents=True)
    (repo / ".gitignore").write_text("/work/\n")
    (repo / "tracked").write_text("t")
    subprocess.run(["git", "-C", str(repo), "init", "-q"], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    (repo / "untracked").write_text("u")
    (repo / "work" / "ignored").write_text("i")
    assert rehearsal.carried_files(repo) == [".gitignore", "tracked", "untracked"]
