"""make forward (build/distbuild/host/forward.py) on a throwaway upstream: the pin in build/forward.toml,
the exact apply (a hunk that fails or applies only at an offset is named), the verdict and where
it is written, and the FlashInfer steps' reading of the compile check's ptxas report and of
pytest's JUnit XML (fed here by hand: the real compile runs in tests/flashinfer, not twice)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from distbuild.errors import DistBuildError
from distbuild.host import forward, forward_lmcache, testrun
from distbuild.pins import Pin, save
from distbuild.series import series_entries

from .conftest import BASE_FILES, DemoRepo, patch_text
from .test_pipeline import P1

SHIFTED = "".join(f"# line {i}\n" for i in range(7))  # seven lines before the code: every hunk moves by 7


def _forward_pin(demo: DemoRepo, pin: Pin) -> None:
    save(demo.root / "build" / "forward.toml", [pin])


def _verdict(demo: DemoRepo) -> str:
    return (demo.work / "forward" / "demo-1.1" / "verdict.txt").read_text()


def test_exact_series_is_good_and_the_verdict_is_written_under_work(demo, capsys):
    demo.series(P1)
    _forward_pin(demo, demo.publish("1.1", BASE_FILES))
    stale = demo.work / "forward" / "demo-1.1" / "activation-bundle" / "SOURCES.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    assert demo.run("forward", "demo==1.1") == 0
    assert not stale.parent.exists()  # an earlier run's outputs are gone
    out = capsys.readouterr().out
    assert "make forward demo==1.1: GOOD" in out
    assert "1 patch(es) applied with git am, no fuzz, no offsets" in out
    assert _verdict(demo) in out
    assert not (demo.root / "build" / "forward").exists()  # nothing written outside the work folder


def test_a_patch_that_does_not_apply_is_named_with_its_hunk(demo, capsys):
    demo.series(P1)
    files = dict(BASE_FILES, **{"demo/core.py": BASE_FILES["demo/core.py"].replace("return 5\n", "return -5\n")})
    _forward_pin(demo, demo.publish("1.1", files))
    assert demo.run("forward", "demo==1.1") == 1
    verdict = _verdict(demo)
    assert "NOT GOOD: apply failed" in verdict
    assert f"{P1[0]} does not apply: hunk #1 of demo/core.py (@@ -16,3 +16,3 @@)" in verdict
    assert "apply    FAILED" in verdict and verdict in capsys.readouterr().out


def test_a_hunk_at_an_offset_stops_the_run_unless_allowed(demo, capsys):
    demo.series(P1)
    _forward_pin(demo, demo.publish("1.1", dict(BASE_FILES, **{"demo/core.py": SHIFTED + BASE_FILES["demo/core.py"]})))
    assert demo.run("forward", "demo==1.1") == 1
    offset = f"{P1[0]}: hunk #1 of demo/core.py (@@ -16,3 +16,3 @@) applies +7 lines off"
    assert "applies only at an offset" in _verdict(demo) and offset in _verdict(demo)
    assert demo.run("forward", "demo==1.1", "--allow-offsets") == 1
    verdict = _verdict(demo)
    assert verdict.startswith("make forward demo==1.1: NOT EXACT") and "apply    offsets" in verdict
    assert offset in verdict and "no fuzz; at offsets (allowed):" in verdict
    capsys.readouterr()


def test_a_release_not_pinned_in_forward_toml_is_refused_with_the_file_named(demo, capsys):
    demo.series(P1)
    _forward_pin(demo, demo.publish("1.1", BASE_FILES))
    assert demo.run("forward", "demo==1.2") == 2
    err = capsys.readouterr().err
    assert "demo==1.2: not pinned in" in err and "forward.toml (it pins demo==1.1)" in err


def test_a_pin_whose_hash_the_index_contradicts_is_not_fetched(demo, capsys):
    demo.series(P1)
    pin = demo.publish("1.1", BASE_FILES)
    _forward_pin(demo, Pin(pin.name, pin.version, pin.kind, pin.role, pin.filename, "0" * 64, pin.size, pin.upstream))
    assert demo.run("forward", "demo==1.1") == 1
    verdict = _verdict(demo)
    assert "NOT GOOD: fetch failed" in verdict and "refusing to download" in verdict
    assert "apply    not run" in verdict
    capsys.readouterr()


def test_hunks_are_numbered_per_file():
    text = patch_text("x", "a.py", "old", "new", ["ctx"], 3).replace("-- \n", "@@ -9,2 +9,2 @@ def f():\n-o\n+n\n-- \n")
    text += "diff --git a/b.py b/b.py\n--- a/b.py\n+++ b/b.py\n@@ -1 +1 @@\n-x\n+y\n"
    assert [(h.path, h.number, h.old_start) for h in forward.hunks(text)] == [("a.py", 1, 3), ("a.py", 2, 9),
                                                                            ("b.py", 1, 1)]
    assert forward.hunks(text)[1].name() == "hunk #2 of a.py (@@ -9,2 +9,2 @@)"


def _report(tree: Path, spill_on: str | None = None) -> dict:
    def kernels(arch: str, tree_name: str) -> dict:
        names = ["activationDeepSeekKernel<float_e4m3_t,1,pdl>", "activationKernel<half_t,1,nopdl>"]
        if tree_name == "patched":
            names.append("activationDeepSeekSmallBatchKernel<bfloat16_t,1,pdl>")
        spill = 8 if (arch, tree_name) == (spill_on, "patched") else 0
        return {n: {"registers": 40 + i, "stack": spill, "spill_stores": spill, "spill_loads": spill}
                for i, n in enumerate(names)}

    return {"tree": str(tree), "flags": {a: ["-O3", f"-gencode={a}"] for a in forward.ARCHS},
            "kernels": {f"{t}/{a}": kernels(a, t) for a in forward.ARCHS for t in ("pristine", "patched")}}


def test_the_compile_step_reports_registers_per_arch_and_fails_on_a_spill(tmp_path):
    path = tmp_path / "ptxas_report.json"
    path.write_text(json.dumps(_report(tmp_path / "tree")))
    lines = forward.compile_lines(path, tmp_path / "tree", tmp_path / "pytest.log")
    assert lines[0] == "nvcc flags read from the tree's flashinfer/jit: 2 for sm_103a (-O3; all in ptxas_report.json)"
    assert lines[1].split() == ["arch", "tree", "kernel", "n", "registers", "stack", "spill", "st/ld"]
    assert "sm_90a   patched   activationDeepSeekSmallBatchKernel  1  42         0      0/0" in lines
    assert len(lines) == 2 + 3 * 5
    path.write_text(json.dumps(_report(tmp_path / "tree", spill_on="sm_100a")))
    with pytest.raises(forward.ForwardStop, match=r"(?s)spill.*DeepSeekKernel<float_e4m3_t,1,pdl> on sm_100a: "
                                                  r"stack 8 B, spills 8/8 B"):
        forward.compile_lines(path, tmp_path / "tree", tmp_path / "pytest.log")


def test_the_compile_step_refuses_a_report_of_another_tree_or_none(tmp_path):
    path = tmp_path / "ptxas_report.json"
    with pytest.raises(forward.ForwardStop, match="wrote no ptxas report"):
        forward.compile_lines(path, tmp_path / "tree", tmp_path / "pytest.log")
    path.write_text(json.dumps(_report(tmp_path / "default-tree")))
    with pytest.raises(forward.ForwardStop, match="did not read DIST_FLASHINFER_TREE"):
        forward.compile_lines(path, tmp_path / "tree", tmp_path / "pytest.log")


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.flashinfer.test_a" name="test_ok" />
<testcase classname="tests.flashinfer.test_a" name="test_ok2" />
<testcase classname="tests.flashinfer.test_b" name="test_gpu"><skipped message="needs a CUDA GPU" /></testcase>
{failing}</testsuite></testsuites>"""


def test_the_tests_step_counts_junit_results_and_names_failures(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT.format(failing=""))
    assert forward.result_lines(forward.junit_results(junit), tmp_path / "log") == [
        f"2 passed, 0 failed, 1 skipped (log {tmp_path / 'log'})", "skipped: needs a CUDA GPU"]
    junit.write_text(JUNIT.format(failing='<testcase classname="tests.flashinfer.test_c" name="test_bad">'
                                          '<failure message="x" /></testcase>'))
    with pytest.raises(forward.ForwardStop, match=r"failed: tests\.flashinfer\.test_c::test_bad"):
        forward.result_lines(forward.junit_results(junit), tmp_path / "log")
    with pytest.raises(forward.ForwardStop, match="pytest wrote no"):
        forward.junit_results(tmp_path / "absent.xml")
    junit.write_text("<testsuites><testsuite>")
    with pytest.raises(forward.ForwardStop, match=r"junit\.xml: not JUnit XML"):
        forward.junit_results(junit)


def test_the_verdict_fits_one_screen_and_says_where_it_stopped():
    verdict = forward.Verdict("flashinfer-python==0.7.4", [
        forward.Step("fetch", "ok", ["file: verified"], 1.0),
        forward.Step("apply", "ok", ["1 patch(es) applied"], 20.0),
        forward.Step("compile", "FAILED", ["spills:", "kernel on sm_90a"], 60.0),
        forward.Step("tests", "not run")], wall_s=81.4)
    text = forward.format_verdict(verdict)
    assert text.splitlines()[0] == "make forward flashinfer-python==0.7.4: NOT GOOD: compile failed, 81 s"
    assert "  compile  FAILED, 60 s\n           spills:\n           kernel on sm_90a" in text
    assert text.splitlines()[-1] == "  tests    not run"
    assert len(text.splitlines()) <= 40


def test_the_kernel_tests_point_at_another_tree_only_when_asked(monkeypatch, tmp_path):
    from tests.flashinfer import activation_build as ab

    monkeypatch.delenv(ab.TREE_ENV, raising=False)
    monkeypatch.setenv("DIST_WORK", str(tmp_path / "work"))
    assert ab.flashinfer_tree() == tmp_path / "work" / "src" / "flashinfer"
    monkeypatch.setenv(ab.TREE_ENV, str(tmp_path / "other"))
    assert ab.flashinfer_tree() == tmp_path / "other"
    with pytest.raises(ab.BuildError, match=f"no FlashInfer tree at {tmp_path / 'other'} .*DIST_FLASHINFER_TREE"):
        ab.patched_sources()


# ---------------------------------------------------------------------------------------------
# The series folder of a release, and LMCache's steps (forward_lmcache.py)

REPO = Path(__file__).resolve().parents[2]


def test_a_release_with_a_series_folder_of_its_own_is_checked_with_that_series(demo, capsys):
    demo.series(P1)
    files = dict(BASE_FILES, **{"demo/core.py": BASE_FILES["demo/core.py"].replace("return 5\n", "return -5\n")})
    _forward_pin(demo, demo.publish("1.1", files))
    forwarded = demo.root / "patches" / "demo-1.1"
    forwarded.mkdir(parents=True)
    name = "0001-return-fifty.patch"
    (forwarded / name).write_text(patch_text("[Bugfix] f5 returns fifty", "demo/core.py", "    return -5",
                                             "    return 50", ["def f5():"], 16))
    (forwarded / "series").write_text(f"{name}\n")
    assert demo.run("forward", "demo==1.1") == 0
    assert "1 patch(es) applied with git am, no fuzz, no offsets (patches/demo-1.1/series)" in _verdict(demo)
    assert forward.series_dir(demo.root / "patches", "demo", "1.1") == forwarded
    assert forward.series_dir(demo.root / "patches", "demo", "1.2") == demo.root / "patches" / "demo"
    capsys.readouterr()


def test_a_series_folder_without_a_series_file_is_refused_with_the_folder_named(demo, capsys):
    demo.series(P1)
    _forward_pin(demo, demo.publish("1.1", BASE_FILES))
    (demo.root / "patches" / "demo-1.1").mkdir(parents=True)
    assert demo.run("forward", "demo==1.1") == 1
    assert "patches/demo-1.1: has no series file" in _verdict(demo)
    capsys.readouterr()


def test_lmcache_056_is_pinned_for_forward_with_its_own_series_folder():
    pin = forward.forward_pin(REPO / "build" / "forward.toml", "lmcache==0.5.6")
    assert (pin.name, pin.kind, pin.role, pin.upstream) == ("lmcache", "sdist", "upstream", "lmcache")
    assert pin.filename == "lmcache-0.5.6.tar.gz" and len(pin.sha256) == 64 and pin.size > 0
    folder = forward.series_dir(REPO / "patches", "lmcache", "0.5.6")
    assert folder == REPO / "patches" / "lmcache-0.5.6"
    assert series_entries(folder / "series") == series_entries(REPO / "patches" / "lmcache" / "series")
    # it keeps the pinned series' leave-out rules, and its declarations name patches of its own series
    assert forward_lmcache.leave_out_rules(folder, REPO / "patches" / "lmcache") == REPO / "patches" / "lmcache"
    declared = forward_lmcache.not_applicable(folder, series_entries(folder / "series"))
    assert [entry.patch for entry in declared] == ["0029-lookup-pins-released-only-by-their-lookup.patch"]
    test_file = REPO / declared[0].node.split("::")[0]
    assert f"def {declared[0].node.split('::')[1]}(" in test_file.read_text()


@pytest.mark.parametrize("line, message", [
    ("0001-a.patch tests/x.py::test_y: why", "not '<patch file> proof <test node id>: <why>'"),
    ("0009-other.patch proof tests/x.py::test_y: why", "0009-other.patch is not in"),
    ("0001-a.patch proof test_y: why", "'test_y' is not a test node id"),
    ("0001-a.patch proof tests/x.py::test_y:", "not '<patch file> proof"),
])
def test_a_bad_not_applicable_line_is_refused_with_its_file_and_line(tmp_path, line, message):
    (tmp_path / "not-applicable").write_text(f"# why these\n\n{line}\n")
    with pytest.raises(DistBuildError, match=re.escape(f"{tmp_path / 'not-applicable'}:3: ") + ".*"
                       + re.escape(message)):
        forward_lmcache.not_applicable(tmp_path, ["0001-a.patch"])


def test_a_proof_declared_twice_is_refused(tmp_path):
    line = "0001-a.patch proof tests/x.py::test_y: the release fixed it"
    (tmp_path / "not-applicable").write_text(f"{line}\n{line}\n")
    with pytest.raises(DistBuildError, match="not-applicable:2: tests/x.py::test_y is declared twice"):
        forward_lmcache.not_applicable(tmp_path, ["0001-a.patch"])
    assert forward_lmcache.not_applicable(tmp_path / "absent", []) == []


def test_a_node_id_is_named_as_junit_names_it():
    assert forward_lmcache.junit_name("tests/lmcache/test_x.py::test_y") == "tests.lmcache.test_x::test_y"
    assert forward_lmcache.junit_name("tests/a/test_x.py::TestC::test_y[p-1]") == "tests.a.test_x.TestC::test_y[p-1]"


REASONS = {
    "tests/lmcache/test_0001_a.py::test_lock": {"patch": "0001-a.patch", "fails_with": "lost completion",
                                                "outcome": "failed", "got": "AssertionError: lost completion",
                                                "stated": True},
    "tests/lmcache/test_0009_b.py::test_shard[2]": {"patch": "0009-b.patch", "fails_with": "owns chunk",
                                                    "outcome": "failed", "stated": False,
                                                    "got": "ModuleNotFoundError: No module named 'lmcache.x'"},
    "tests/lmcache/test_0009_b.py::test_gpu": {"patch": "0009-b.patch", "fails_with": "x", "outcome": "skipped",
                                               "got": "", "stated": False},
}


def test_the_proof_rows_say_how_each_proof_failed_on_pristine_and_did_on_the_series(tmp_path):
    series = testrun.Outcome(passed={"tests.lmcache.test_0001_a::test_lock", "tests.lmcache.test_0009_b::test_shard[2]",
                                     "tests.lmcache.test_0029_c::test_sync"},
                             skipped={"tests.lmcache.test_0009_b::test_gpu"})
    declared = [forward_lmcache.NotApplicable("0029-c.patch", "tests/lmcache/test_0029_c.py::test_sync", "fixed")]
    rows = forward_lmcache.proof_rows(REASONS, series, declared)
    assert [(r.patch, r.pristine.split(":")[0], r.series) for r in rows] == [
        ("0001-a.patch", "stated", "passed"), ("0009-b.patch", "skipped", "skipped"),
        ("0009-b.patch", "other", "passed"), ("0029-c.patch", "not applicable", "passed")]
    summary = forward_lmcache.proof_summary(rows, "9.9")
    assert summary[0] == "failed on pristine 9.9 for their stated reason: 1: 0001"
    assert summary[1] == "failed on pristine 9.9 before their stated reason: 1: 0009"
    assert summary[2].startswith("  (1 ModuleNotFoundError;")
    table = forward_lmcache.write_proof_table(rows, tmp_path / "proofs.txt", "9.9").read_text()
    assert "0029-c.patch\ttests/lmcache/test_0029_c.py::test_sync\tnot applicable\tpassed" in table


def test_the_reasons_file_must_be_there_and_json(tmp_path):
    with pytest.raises(DistBuildError, match="wrote no"):
        forward_lmcache.read_reasons(tmp_path / "absent.json")
    (tmp_path / "r.json").write_text("{")
    with pytest.raises(DistBuildError, match=r"r\.json: not the JSON proof_reasons\.py writes"):
        forward_lmcache.read_reasons(tmp_path / "r.json")


def test_a_failing_check_does_not_hide_the_others_and_a_skipped_one_makes_the_run_partial():
    verdict = forward.Verdict("lmcache==0.5.6", [
        forward.Step("fetch", "ok", ["verified"], 1.0), forward.Step("apply", "ok", ["29 patch(es)"], 9.0),
        forward.Step("build", "ok", ["wheels"], 700.0),
        forward.Step("proofs", "FAILED", ["proofs on pristine 0.5.6: 1 proof(s) did not fail"], 900.0),
        forward.Step("suite", "ok", ["no regression"], 300.0), forward.Step("engine", "skipped", ["ENGINE=0"])],
        wall_s=1910.0)
    text = forward.format_verdict(verdict)
    assert text.splitlines()[0] == "make forward lmcache==0.5.6: NOT GOOD: proofs failed, 1910 s (31.8 min)"
    assert "  build    ok, 700 s (11.7 min)" in text and "  engine   skipped\n           ENGINE=0" in text
    assert not verdict.good
    verdict.steps[3] = forward.Step("proofs", "ok", [], 900.0)
    assert forward.headline(verdict) == "PARTIAL: every step that ran passed; skipped: engine (ENGINE=0)"


def test_a_new_run_keeps_only_the_venvs_of_the_last(tmp_path):
    out = tmp_path / "lmcache-9.9"
    for name in ("venv", "venv-engine", "lmcache-pristine", "tree", "logs"):
        (out / name).mkdir(parents=True)
    (out / "verdict.txt").write_text("old")
    forward.start_afresh(out, forward_lmcache.KEPT)
    assert sorted(p.name for p in out.iterdir()) == ["lmcache-pristine", "venv", "venv-engine"]
    forward.start_afresh(out, ())
    assert list(out.iterdir()) == []


def test_the_flags_name_the_steps_they_skip(tmp_path):
    setup = forward_lmcache.Setup(wheels=tmp_path, vllm_wheel=lambda: tmp_path, nixl_wheel=lambda: tmp_path,
                                  suite=False, engine=False)
    assert setup.skipped() == {"suite": "SUITE=0", "engine": "ENGINE=0"}
    steps = forward_lmcache.LMCacheForward(REPO, setup, tmp_path, "9.9").steps()
    assert [(name, action is None) for name, action in steps] == [
        ("build", False), ("proofs", False), ("suite", True), ("engine", True)]


def test_a_restated_reason_is_read_with_its_regex_and_a_broken_regex_is_refused(tmp_path):
    line = "0001-a.patch proof tests/x.py::test_y fails with /layer\\.attn': 'NL_X/: the release reads it another way"
    (tmp_path / "fails-with").write_text(f"# why\n{line}\n")
    (entry,) = forward_lmcache.restated(tmp_path, ["0001-a.patch"])
    assert (entry.node, entry.regex, entry.why) == ("tests/x.py::test_y", "layer\\.attn': 'NL_X",
                                                    "the release reads it another way")
    (tmp_path / "fails-with").write_text("0001-a.patch proof tests/x.py::test_y fails with /(unclosed/: why\n")
    with pytest.raises(DistBuildError, match=r"fails-with: the regex of tests/x.py::test_y does not compile"):
        forward_lmcache.restated(tmp_path, ["0001-a.patch"])
    (tmp_path / "fails-with").write_text("0001-a.patch proof tests/x.py::test_y: no regex\n")
    with pytest.raises(DistBuildError, match=r"fails-with:1: not '<patch file> proof <test node id> fails with"):
        forward_lmcache.restated(tmp_path, ["0001-a.patch"])


def test_the_056_restated_reasons_name_proofs_of_their_patch():
    folder = REPO / "patches" / "lmcache-0.5.6"
    for entry in forward_lmcache.restated(folder, series_entries(folder / "series")):
        path, test = entry.node.split("::")
        text = (REPO / path).read_text()
        assert f"def {test}(" in text
        marked = text[:text.index(f"def {test}(")].rsplit("@pytest.mark.fixes(", 1)[1]
        constant = marked.split(",", 1)[0].strip()
        assert entry.patch in (constant.strip("\"'"), re.search(rf'^{constant} = "(.+)"', text, re.M)[1])
