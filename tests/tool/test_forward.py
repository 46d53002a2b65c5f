"""make forward (build/distbuild/host/forward.py) on a throwaway upstream: the pin in build/forward.toml,
the exact apply (a hunk that fails or applies only at an offset is named), the verdict and where
it is written, and the FlashInfer steps' reading of the compile check's ptxas report and of
pytest's JUnit XML (fed here by hand: the real compile runs in tests/flashinfer, not twice)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from distbuild.host import forward
from distbuild.pins import Pin, save

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
