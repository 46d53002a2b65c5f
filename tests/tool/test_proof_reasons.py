"""The proof marker's leave-one-out mode (tests/conftest.py), run by real pytest.

Each case writes a small test file into a pytester folder whose conftest takes
the project's own hooks, and runs pytest on it with ``DIST_LMCACHE_TREE`` set
as the leave-one-out phase sets it.
"""
from __future__ import annotations

import pytest

from tests.conftest import patch_parts, series_patches

pytest_plugins = ["pytester"]

PATCH = sorted(series_patches())[0]
OTHER = sorted(series_patches())[1]

CONFTEST = """
from tests.conftest import pytest_configure, pytest_collection_modifyitems, pytest_runtest_makereport
"""


def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tree: str, body: str) -> pytest.RunResult:
    monkeypatch.setenv("DIST_LMCACHE_TREE", tree)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_proof=f"import pytest\nPATCH = {PATCH!r}\nOTHER = {OTHER!r}\n{body}")
    return pytester.runpytest("-p", "no:cacheprovider", "-q")


def test_a_proof_failing_for_its_stated_reason_counts_as_failing(pytester, monkeypatch):
    result = run(pytester, monkeypatch, f"without:{PATCH}", """
@pytest.mark.fixes(PATCH, fails_with=r"AssertionError: 2 pins left")
def test_pins():
    assert False, "2 pins left"
""")
    result.assert_outcomes(xfailed=1)


def test_a_proof_failing_for_another_reason_is_a_failure(pytester, monkeypatch):
    result = run(pytester, monkeypatch, f"without:{PATCH}", """
@pytest.mark.fixes(PATCH, fails_with=r"2 pins left")
def test_pins():
    import lmcache_module_that_does_not_exist
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*failed without it for another reason*ModuleNotFoundError*"])


def test_a_proof_without_a_stated_reason_is_a_failure(pytester, monkeypatch):
    result = run(pytester, monkeypatch, f"without:{PATCH}", """
@pytest.mark.fixes(PATCH)
def test_pins():
    assert False
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*states no expected failure*"])


def test_a_proof_passing_without_its_patch_is_a_failure(pytester, monkeypatch):
    result = run(pytester, monkeypatch, f"without:{PATCH}", """
@pytest.mark.fixes(PATCH, fails_with="x")
def test_pins():
    pass
""")
    result.assert_outcomes(failed=1)


def test_only_the_left_out_patch_proofs_run(pytester, monkeypatch):
    result = run(pytester, monkeypatch, f"without:{PATCH}", """
@pytest.mark.fixes(OTHER, fails_with="x")
def test_other_patch():
    pass

def test_plain():
    pass

@pytest.mark.fixes(PATCH, fails_with="boom")
def test_mine():
    raise RuntimeError("boom")
""")
    result.assert_outcomes(xfailed=1, deselected=2)


def test_the_pristine_phase_is_unchanged(pytester, monkeypatch):
    result = run(pytester, monkeypatch, "pristine", """
@pytest.mark.fixes(PATCH, fails_with=r"never matched")
def test_pins():
    raise ImportError("no module")
""")
    result.assert_outcomes(xfailed=1)


def test_an_unknown_left_out_patch_is_a_usage_error(pytester, monkeypatch):
    result = run(pytester, monkeypatch, "without:9999-nope.patch", "def test_x():\n    pass\n")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_a_proof_whose_setup_fails_is_an_error_not_the_expected_failure(pytester, monkeypatch):
    # A fixture that fails (an engine that does not start, a port taken)
    # says nothing about the patch, even if its message matches fails_with.
    result = run(pytester, monkeypatch, f"without:{PATCH}", """
@pytest.fixture
def engine():
    raise RuntimeError("address already in use: 2 pins left")

@pytest.mark.fixes(PATCH, fails_with=r"2 pins left")
def test_pins(engine):
    assert False, "2 pins left"
""")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*did not get to run its test: setup failed with RuntimeError: "
                                 "address already in use*"])


def test_on_pristine_a_proof_failing_in_setup_still_counts_as_failing(pytester, monkeypatch):
    # Pristine lacks the patched modules a fixture may import: any failure counts there.
    result = run(pytester, monkeypatch, "pristine", """
@pytest.fixture
def collectives():
    import lmcache_module_that_does_not_exist

@pytest.mark.fixes(PATCH, fails_with=r"x")
def test_pins(collectives):
    pass
""")
    result.assert_outcomes(xfailed=1)


def test_a_skipped_proof_stays_skipped(pytester, monkeypatch):
    result = run(pytester, monkeypatch, f"without:{PATCH}", """
@pytest.fixture
def gpu():
    pytest.skip("needs a CUDA GPU")

@pytest.mark.fixes(PATCH, fails_with=r"x")
def test_pins(gpu):
    assert False
""")
    result.assert_outcomes(skipped=1)


def test_a_collection_writes_which_files_hold_each_patch_proofs(pytester, monkeypatch, tmp_path):
    # Phase 2 writes it; phase 3 then collects only these files per variant (testrun.read_proof_map).
    import json

    proof_map = tmp_path / "proof-map.json"
    monkeypatch.setenv("DIST_PROOF_MAP", str(proof_map))
    pytester.makepyfile(test_other=f"""
import pytest

@pytest.mark.fixes({OTHER!r}, fails_with="x")
def test_other():
    pass
""")
    result = run(pytester, monkeypatch, "patched", """
@pytest.mark.fixes(PATCH, fails_with="x")
def test_pins():
    pass

def test_plain():
    pass
""")
    result.assert_outcomes(passed=3)
    assert json.loads(proof_map.read_text()) == {OTHER: ["test_other.py"], PATCH: ["test_proof.py"]}


# A part of a patch (tests/parts/): its proofs run on the tree without that part only.
PART_PATCH, PART = sorted(patch_parts())[0]


def run_parts(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tree: str, body: str) -> pytest.RunResult:
    """As run(), with the part's names in the test file and the xfail reasons shown (-rx)."""
    monkeypatch.setenv("DIST_LMCACHE_TREE", tree)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_proof=f"import pytest\nPART_PATCH = {PART_PATCH!r}\nPART = {PART!r}\n{body}")
    return pytester.runpytest("-p", "no:cacheprovider", "-q", "-rx")


PART_AND_WHOLE = """
@pytest.mark.fixes(PART_PATCH, part=PART, fails_with=r"raced")
def test_part():
    raise AssertionError("raced")

@pytest.mark.fixes(PART_PATCH, fails_with=r"no load")
def test_whole():
    raise AssertionError("no load")
"""


def test_a_part_proof_runs_on_the_tree_without_that_part_only(pytester, monkeypatch):
    result = run_parts(pytester, monkeypatch, f"without:{PART_PATCH}:{PART}", PART_AND_WHOLE)
    result.assert_outcomes(xfailed=1, deselected=1)
    result.stdout.fnmatch_lines([f"*test_part*proof of the {PART} part of {PART_PATCH}: must fail without it*"])


def test_the_tree_without_the_whole_patch_leaves_its_part_proofs_out(pytester, monkeypatch):
    result = run_parts(pytester, monkeypatch, f"without:{PART_PATCH}", PART_AND_WHOLE)
    result.assert_outcomes(xfailed=1, deselected=1)
    result.stdout.fnmatch_lines([f"*test_whole*proof of {PART_PATCH}: must fail without it*"])


def test_on_pristine_a_part_proof_is_a_proof_like_any_other(pytester, monkeypatch):
    result = run_parts(pytester, monkeypatch, "pristine", PART_AND_WHOLE)
    result.assert_outcomes(xfailed=2)


def test_a_part_proof_failing_for_another_reason_is_a_failure(pytester, monkeypatch):
    result = run_parts(pytester, monkeypatch, f"without:{PART_PATCH}:{PART}", """
@pytest.mark.fixes(PART_PATCH, part=PART, fails_with=r"paged KV differs")
def test_part():
    assert [256] == [6144]
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*proof of the {PART} part of {PART_PATCH} failed without it for another "
                                 "reason: expected /paged KV differs/, got AssertionError*"])


def test_a_part_no_diff_removes_is_a_usage_error(pytester, monkeypatch):
    result = run_parts(pytester, monkeypatch, "patched", """
@pytest.mark.fixes(PART_PATCH, part="no-such-part", fails_with=r"x")
def test_part():
    pass
""")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result = run_parts(pytester, monkeypatch, f"without:{PART_PATCH}:no-such-part", "def test_x():\n    pass\n")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_the_reasons_plugin_records_how_each_proof_failed_on_pristine(pytester, monkeypatch, tmp_path):
    import json

    reasons = tmp_path / "reasons.json"
    monkeypatch.setenv("DIST_LMCACHE_TREE", "pristine")
    monkeypatch.setenv("DIST_PROOF_REASONS", str(reasons))
    broken = "\nimport pytest\n@pytest.fixture\ndef broken():\n    raise OSError('port taken')\n"
    pytester.makeconftest(CONFTEST + broken)
    pytester.makepyfile(test_proof=f"""import pytest
PATCH = {PATCH!r}
@pytest.mark.fixes(PATCH, fails_with=r"2 pins left")
def test_stated():
    assert False, "2 pins left"

@pytest.mark.fixes(PATCH, fails_with=r"2 pins left")
def test_other():
    import lmcache_module_that_does_not_exist

@pytest.mark.fixes(PATCH, fails_with=r"x")
def test_passes():
    pass

@pytest.mark.fixes(PATCH, fails_with=r"x")
def test_setup(broken):
    pass

def test_plain():
    pass
""")
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "tests.support.proof_reasons", "-q")
    result.assert_outcomes(xfailed=3, failed=1, passed=1)   # strict xfail: the proof that passes fails the run
    records = json.loads(reasons.read_text())
    assert sorted(records) == [f"test_proof.py::test_{n}" for n in ("other", "passes", "setup", "stated")]
    assert records["test_proof.py::test_stated"]["stated"] is True
    other = records["test_proof.py::test_other"]
    assert (other["outcome"], other["stated"]) == ("failed", False) and other["got"].startswith("ModuleNotFoundError")
    assert records["test_proof.py::test_passes"]["outcome"] == "passed"
    assert records["test_proof.py::test_setup"]["outcome"] == "setup failed"
    assert records["test_proof.py::test_setup"]["got"] == "OSError: port taken"


def test_a_restated_reason_replaces_the_proofs_own(pytester, monkeypatch, tmp_path):
    import json

    restated = tmp_path / "restated.json"
    restated.write_text(json.dumps({"test_proof.py::test_case": "latent read as fused"}))
    monkeypatch.setenv("DIST_PROOF_RESTATED", str(restated))
    monkeypatch.setenv("DIST_LMCACHE_TREE", f"without:{PATCH}")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_proof=f"""import pytest
PATCH = {PATCH!r}
@pytest.mark.fixes(PATCH, fails_with=r"indexer read as fused")
@pytest.mark.parametrize("n", [1, 2])
def test_case(n):
    assert False, "latent read as fused"

@pytest.mark.fixes(PATCH, fails_with=r"indexer read as fused")
def test_other():
    assert False, "latent read as fused"
""")
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "tests.support.proof_reasons", "-q")
    result.assert_outcomes(xfailed=2, failed=1)   # both cases restated; the proof not declared keeps its reason
    result.stdout.fnmatch_lines(["*failed without it for another reason: expected /indexer read as fused/*",
                                "FAILED test_proof.py::test_other*"])
