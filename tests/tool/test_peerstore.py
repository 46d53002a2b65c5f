"""Phase 4's kept results (build/distbuild/host/peerstore.py): an identical run is read back, a
changed input runs again, and only what may stand for a later run is kept.

The runs are real: pytest on a small git tree with a pristine ref and a patched HEAD, and the
real Valkey phase 4 starts. Each test file appends to a file outside the tree when it runs, so
the tests see which runs pytest really made."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distbuild.errors import DistBuildError
from distbuild.gitrepo import PRISTINE_REF
from distbuild.host import peerstore, testrun

TEST_FILE = ("from pathlib import Path\n"
             "import os\n"
             "def test_{name}():\n"
             "    with open(os.environ['RAN_LOG'], 'a') as f:\n"
             "        f.write('{label}\\n')\n"
             "    assert {ok}\n")


def _git(tree: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tree, check=True,
                   capture_output=True)


def _commit(tree: Path, files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", message)


@pytest.fixture
def lmcache_like(tmp_path) -> Path:
    """A tree whose pristine ref has one test, and whose HEAD (the 'series') changes nothing yet."""
    tree = tmp_path / "tree"
    tree.mkdir()
    _git(tree, "init", "-q")
    _commit(tree, {"tests/test_up.py": TEST_FILE.format(name="up", label="up", ok="True")}, "pristine")
    _git(tree, "update-ref", PRISTINE_REF, "HEAD")
    _commit(tree, {"lmcache/x.py": "VALUE = 1\n"}, "series")
    return tree


def _run(tree: Path, work: Path, store: peerstore.PeerStore) -> testrun.PeerRun:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "RAN_LOG": str(work / "ran.log")}
    return testrun.run_peer_suite(Path(sys.executable), work, tree, ["tests"], env, env, store)


def _ran(work: Path) -> list[str]:
    log = work / "ran.log"
    runs = log.read_text().split() if log.exists() else []
    log.unlink(missing_ok=True)
    return runs


def test_an_identical_run_is_read_back_and_a_changed_tree_runs_again(lmcache_like, tmp_path, capsys):
    work, store = tmp_path / "work", peerstore.PeerStore(tmp_path / "store")
    first = _run(lmcache_like, work, store)
    assert _ran(work) == ["up", "up"] and not first.reused
    second = _run(lmcache_like, work, store)
    assert _ran(work) == [] and set(second.reused) == {"pristine", "patched"}
    assert second.pristine.passed == first.pristine.passed and second.patched.passed == first.patched.passed
    assert "reused the result of an identical run" in (work / "logs" / "phase-4-patched.log").read_text()
    _commit(lmcache_like, {"tests/test_new.py": TEST_FILE.format(name="new", label="new", ok="True")}, "a test")
    third = _run(lmcache_like, work, store)
    assert sorted(_ran(work)) == ["new", "up"] and set(third.reused) == {"pristine"}


def test_a_miss_names_the_input_that_moved(lmcache_like, tmp_path, capsys):
    """A run of a kept tree that reruns says which of its inputs differs from the kept run's: here
    one more distribution on the patched run's path."""
    work, store = tmp_path / "work", peerstore.PeerStore(tmp_path / "store")
    _run(lmcache_like, work, store)
    _ran(work)
    site = tmp_path / "site"
    (site / "probe_dist-1.2.dist-info").mkdir(parents=True)
    (site / "probe_dist-1.2.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: probe-dist\n"
                                                                 "Version: 1.2\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "RAN_LOG": str(work / "ran.log")}
    capsys.readouterr()
    rerun = testrun.run_peer_suite(Path(sys.executable), work, lmcache_like, ["tests"], env,
                                   {**env, "PYTHONPATH": str(site)}, store)
    assert _ran(work) == ["up"] and set(rerun.reused) == {"pristine"}
    out = capsys.readouterr().out
    assert "patched: no kept result to reuse: the kept run of tree" in out, out
    assert "differs in distributions: kept nothing else; now probe-dist==1.2" in out, out


def test_a_patched_run_with_a_regression_is_not_kept(lmcache_like, tmp_path):
    work, store = tmp_path / "work", peerstore.PeerStore(tmp_path / "store")
    _commit(lmcache_like, {"tests/test_up.py": TEST_FILE.format(name="up", label="broken", ok="False")}, "breaks")
    run = _run(lmcache_like, work, store)
    assert run.regressed() == {"tests.test_up::test_up"}
    _ran(work)
    again = _run(lmcache_like, work, store)
    assert set(again.reused) == {"pristine"} and "broken" in _ran(work)


def test_fresh_runs_both_again(lmcache_like, tmp_path, monkeypatch):
    work, store = tmp_path / "work", peerstore.PeerStore(tmp_path / "store")
    _run(lmcache_like, work, store)
    _ran(work)
    monkeypatch.setenv(peerstore.FRESH_ENV, "fresh")
    assert not _run(lmcache_like, work, store).reused and _ran(work) == ["up", "up"]
    monkeypatch.setenv(peerstore.FRESH_ENV, "sometimes")
    with pytest.raises(DistBuildError, match="DIST_PEER_RESULTS='sometimes'"):
        _run(lmcache_like, work, store)


def test_a_damaged_kept_result_is_not_read(tmp_path):
    store = peerstore.PeerStore(tmp_path / "store")
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="t" name="a"/></testsuite></testsuites>')
    store.keep("k", junit, "tree")
    assert store.lookup("k", tmp_path / "copy.xml") is not None
    (tmp_path / "store" / "k" / "junit.xml").write_text("<testsuites/>")
    assert store.lookup("k", tmp_path / "copy2.xml") is None and not (tmp_path / "copy2.xml").exists()
    assert store.lookup("absent", tmp_path / "copy3.xml") is None
    inputs = peerstore.run_inputs(**BASE_KEY)
    store.keep(peerstore.inputs_key(inputs), junit, "t", inputs)
    (tmp_path / "store" / peerstore.inputs_key(inputs) / "junit.xml").write_text("<testsuites/>")
    assert "has a damaged or missing junit file" in store.why_missed(inputs)


BASE_KEY = {"tree_hash": "t", "args": ["tests"], "dists": "3.11\nlmcache==0.5.5", "valkey": "Valkey 8"}


@pytest.mark.parametrize("field, value", [("tree_hash", "u"), ("args", ["tests", "-k", "x"]),
                                          ("dists", "3.11\nlmcache==0.5.6"), ("valkey", "Valkey 9")])
def test_every_input_is_in_the_key(field, value):
    assert peerstore.run_key(**BASE_KEY) == peerstore.run_key(**dict(BASE_KEY))
    assert peerstore.run_key(**BASE_KEY) != peerstore.run_key(**{**BASE_KEY, field: value})


def test_the_distributions_read_with_the_runs_environment_include_its_pythonpath(tmp_path):
    site = tmp_path / "site"
    (site / "probe_dist-1.2.dist-info").mkdir(parents=True)
    (site / "probe_dist-1.2.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: probe-dist\n"
                                                                 "Version: 1.2\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    assert "probe-dist==1.2" in peerstore.distributions(Path(sys.executable), env)
    assert "probe-dist==1.2" not in peerstore.distributions(Path(sys.executable), dict(os.environ))
