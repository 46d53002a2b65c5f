"""make test's venv locks (build/distbuild/host/testlock.py, build/lock/test-venv.txt and test-engine.txt).

The committed locks are checked against the venvs this very run was given: the
test venv is the interpreter running these tests, the engine venv the one
``DIST_ENGINE_PYTHON`` names. A lock that did not take effect fails here.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from distbuild.errors import DistBuildError
from distbuild.host import testenv, testlock


def _lock(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "test-venv.txt"
    path.write_text(text)
    return path


def test_a_lock_reads_its_inputs_and_pins(tmp_path):
    lock = testlock.read(_lock(tmp_path, "# title\n# inputs: 0123456789abcdef\nnumpy==2.3.1\nruff==0.15.0\n"))
    assert lock.inputs == "0123456789abcdef"
    assert lock.pins == ("numpy==2.3.1", "ruff==0.15.0")
    assert lock.constraints() == "numpy==2.3.1\nruff==0.15.0\n"


def test_a_lock_without_its_inputs_line_is_refused_by_name(tmp_path):
    path = _lock(tmp_path, "numpy==2.3.1\n")
    with pytest.raises(DistBuildError, match=f"{path}: no '# inputs: <hash>' line; remake it with `make lock-test`"):
        testlock.read(path)


def test_a_line_that_is_not_a_pin_is_refused_with_its_line_number(tmp_path):
    path = _lock(tmp_path, "# inputs: 0123456789abcdef\nnumpy>=2\n")
    with pytest.raises(DistBuildError, match=f"{path}:2: 'numpy>=2' is not a name==version pin"):
        testlock.read(path)


def test_a_missing_lock_names_the_command_that_makes_it(tmp_path):
    with pytest.raises(DistBuildError, match="cannot read the test lock.*make lock-test"):
        testlock.read(tmp_path / "absent.txt")


def test_a_venv_is_not_made_from_a_lock_of_other_requirements(tmp_path):
    tree = tmp_path / "lmcache"
    (tree / "requirements").mkdir(parents=True)
    (tree / "requirements" / "common.txt").write_text("numpy\n")
    lock = _lock(tmp_path, "# inputs: 0123456789abcdef\nnumpy==2.3.1\n")
    venv = tmp_path / "venv"
    now = testenv.venv_inputs(tree, [])
    with pytest.raises(DistBuildError, match=re.escape(f"{lock}: made from other requirements") + ".*"
                       + re.escape(f"(inputs 0123456789abcdef, now {now}); remake it with `make lock-test`")):
        testenv.ensure_venv(venv, tree, tmp_path / "logs", [], lock=lock)
    assert not venv.exists(), "a refused lock must leave nothing behind"


def test_frozen_pins_drop_local_labels_and_what_the_tool_installs_itself():
    pins = testlock.frozen(Path(sys.executable))
    names = {pin.split("==")[0] for pin in pins}
    assert "pytest" in names
    assert not names & testlock.NOT_LOCKED
    assert all("+" not in pin for pin in pins)
    assert [pin.split('==')[0] for pin in pins] == sorted(names)


def _differences(lock: testlock.Lock, python: Path) -> list[str]:
    installed = dict(pin.split("==", 1) for pin in testlock.frozen(python))
    return [f"{pin} (installed: {installed.get(pin.split('==')[0], 'absent')})"
            for pin in lock.pins if installed.get(pin.split("==")[0]) != pin.split("==")[1]]


def test_the_test_venv_holds_exactly_its_committed_lock():
    if not Path(sys.prefix, "dist-requirements").is_file():
        pytest.skip(f"{sys.prefix} is not a venv make test made (no dist-requirements stamp)")
    lock = testlock.read(testlock.VENV_LOCK)
    assert _differences(lock, Path(sys.executable)) == []
    unlocked = sorted(set(testlock.frozen(Path(sys.executable))) - set(lock.pins))
    assert unlocked == [], f"installed but not in {testlock.VENV_LOCK.name}: {unlocked}"


def test_the_engine_venv_holds_its_committed_lock():
    python = os.environ.get("DIST_ENGINE_PYTHON")
    if not python:
        pytest.skip("DIST_ENGINE_PYTHON is not set (make test sets it)")
    assert _differences(testlock.read(testlock.ENGINE_LOCK), Path(python)) == []
