"""Proof of 0002-redis-connector-missing-key-is-a-miss.patch: batch completion ordering.

``ConnectorBase`` (csrc/storage_backends/connector_base.h) splits a batch GET
into tiles run by several worker threads. Each tile writes its keys' per-key
results (and the GET's buffers) and decrements ``remaining_tiles``; the tile
that brings it to 0 moves ``per_key_results`` into the completion that the
Python side drains on another thread and trusts since 0002/0003 (a miss is a
per-key 0). The pristine decrement is ``memory_order_relaxed``, so nothing
orders the other tiles' writes before the completion: a C++ data race that
ThreadSanitizer reports (as upstream LMCache found, issue #5293).

tests/lmcache/csrc/batch_completion_tsan.cpp drives that path with real
ConnectorBase code and a connector whose tiles meet (through relaxed atomics,
which order nothing) before writing, so every tile runs on its own worker
whatever the machine's load: the race is there in every batch, not only when
the scheduler spreads the tiles. It is compiled here with ``g++ -fsanitize=thread``
against the headers of the LMCache tree whose build is under test: the tree
named by the ``dist-lmcache-tree`` stamp next to the imported ``lmcache``
package (or in the venv), read from the git repository that holds it
(work/src/lmcache, or ``DIST_LMCACHE_SRC``).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PATCH = "0002-redis-connector-missing-key-is-a-miss.patch"

pytestmark = pytest.mark.lmcache

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "csrc" / "batch_completion_tsan.cpp"
STAMP = "dist-lmcache-tree"  # written by build/distbuild/host/testenv.py install()
HEADERS = ("connector_base.h", "connector_types.h", "connector_interface.h", "event_notifier.h")
RUN_TIMEOUT_S = 120


def _tree_under_test() -> str:
    import lmcache

    package_parent = Path(lmcache.__file__).resolve().parent.parent
    # The venv's stamp names only the build installed in the venv; a site folder put ahead of it on
    # PYTHONPATH (pristine, a leave-one-out variant) must name its own tree.
    installed_in_venv = package_parent.is_relative_to(Path(sys.prefix).resolve())
    stamps = (package_parent / STAMP, Path(sys.prefix) / STAMP) if installed_in_venv else (package_parent / STAMP,)
    for stamp in stamps:
        if stamp.is_file():
            return stamp.read_text().strip()
    raise FileNotFoundError(f"no {STAMP} stamp in {' or '.join(str(s.parent) for s in stamps)}: "
                            f"which tree is the lmcache package in {package_parent} built from?")


def _tsan_compiler(tmp_path: Path) -> str:
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        pytest.skip("no C++ compiler (g++) to build the ThreadSanitizer driver")
    probe = tmp_path / "probe.cpp"
    probe.write_text("#include <thread>\nint main() { std::thread t([] {}); t.join(); }\n")
    done = subprocess.run([cxx, "-fsanitize=thread", "-pthread", str(probe), "-o", str(tmp_path / "probe")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"{cxx} cannot build with -fsanitize=thread here: {done.stderr.strip()[:300]}")
    run = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        pytest.skip(f"ThreadSanitizer binaries do not run here: {run.stderr.strip()[:300]}")
    return cxx


@pytest.mark.fixes(PATCH,
                   fails_with=r"AssertionError: ThreadSanitizer reports a data race in the batch completion path")
def test_batch_completion_publishes_every_tile_to_the_drainer(tmp_path):
    cxx = _tsan_compiler(tmp_path)
    tree = _tree_under_test()
    source_repo = Path(os.environ.get("DIST_LMCACHE_SRC", REPO / "work" / "src" / "lmcache"))
    include = tmp_path / "include"
    include.mkdir()
    for header in HEADERS:
        shown = subprocess.run(["git", "-C", str(source_repo), "show", f"{tree}:csrc/storage_backends/{header}"],
                               capture_output=True, check=False)
        assert shown.returncode == 0, (
            f"tree {tree} (the build under test) is not in {source_repo}: {shown.stderr.decode().strip()}"
        )
        (include / header).write_bytes(shown.stdout)

    binary = tmp_path / "batch_completion_tsan"
    built = subprocess.run([cxx, "-std=c++17", "-fsanitize=thread", "-g", "-O1", "-pthread", f"-I{include}",
                            str(DRIVER), "-o", str(binary)], capture_output=True, text=True)
    assert built.returncode == 0, f"the driver does not build against tree {tree}:\n{built.stderr[-3000:]}"
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=0 exitcode=66")
    run = subprocess.run([str(binary)], capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
    report = run.stderr
    races = report.count("WARNING: ThreadSanitizer: data race")
    if races:
        first = report[report.index("WARNING: ThreadSanitizer: data race"):][:1500]
        raise AssertionError(
            f"ThreadSanitizer reports a data race in the batch completion path ({races} reports) in tree {tree}; "
            f"the first:\n{first}"
        )
    assert run.returncode == 0, f"driver exited with {run.returncode}:\n{run.stdout}\n{report[-2000:]}"
    assert "bad_results=0" in run.stdout, run.stdout
