"""Why each proof failed, written out: a pytest plugin for ``make forward UPSTREAM=lmcache==<version>``.

Loaded with ``-p tests.support.proof_reasons`` beside the project's conftest. With
``DIST_PROOF_REASONS=<file>`` it writes, at the end of the session, one JSON record per proof
(a test marked ``@pytest.mark.fixes``) that ran: its patch and part, its ``fails_with``, what its
test did (``passed``, ``failed``, ``setup failed``, ``skipped``), what it failed with (the text
``fails_with`` is matched against, as tests/conftest.py matches it) and whether that is the
failure it states.

With ``DIST_PROOF_RESTATED=<file>`` (JSON: ``{node id: regex}``) it first gives each proof whose
node id starts with one of those a ``fails_with`` of that regex instead of its own: the reason a
proof fails for on a newer release where that release changed how the failure shows (the series
folder of that release declares each, with why; build/distbuild/host/forward_lmcache.py). The
proof's patch and part stay; the project's conftest then judges it by the restated reason.

With ``DIST_PROOF_MARKERS=<file>`` it writes, once the session collected its tests, the marker of
each proof collected (``{node id: {patch, part, fails_with}}``): a ``--collect-only`` run of some node
ids says which patch each of them proves without running it (the picks of make test's phase 2b,
build/distbuild/host/forward_picks.py).

On the pristine tree phase 2's rule decides (strict xfail: every proof must fail); what it
failed with is not kept there (pytest's JUnit XML records an xfail by its reason only). These
records say which proofs failed for their stated reason and which failed before they got to it,
for instance on a module a patch earlier in the series adds.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import fails_as_stated, failure_text

REASONS_ENV = "DIST_PROOF_REASONS"
RESTATED_ENV = "DIST_PROOF_RESTATED"
MARKERS_ENV = "DIST_PROOF_MARKERS"
CLIP = 600  # characters of a failure kept: enough for its type and the line that says why

_records: dict[str, dict[str, object]] = {}


def _outcome(when: str, excinfo: pytest.ExceptionInfo | None) -> str:
    if excinfo is None:
        return "passed"
    if excinfo.errisinstance(pytest.skip.Exception):
        return "skipped"
    return "setup failed" if when == "setup" else "failed"


def record(marker: pytest.Mark, when: str, excinfo: pytest.ExceptionInfo | None) -> dict[str, object]:
    """One proof's record from the phase that decided it (its setup when that raised, else its call)."""
    expected = marker.kwargs.get("fails_with")
    outcome = _outcome(when, excinfo)
    got = failure_text(excinfo) if outcome in ("failed", "setup failed") else ""
    stated = outcome == "failed" and expected is not None and fails_as_stated(expected, got)
    return {"patch": marker.args[0] if marker.args else None, "part": marker.kwargs.get("part"),
            "fails_with": expected, "outcome": outcome, "got": got[:CLIP], "stated": stated}


def restated(nodeid: str, reasons: dict[str, str]) -> str | None:
    """The restated ``fails_with`` of a proof: the one of the declared node id it is, or is a case of."""
    for node, regex in reasons.items():
        if nodeid == node or nodeid.startswith(node + "["):
            return regex
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    source = os.environ.get(RESTATED_ENV)
    if not source:
        return
    reasons = json.loads(Path(source).read_text())
    for item in items:
        marker = item.get_closest_marker("fixes")
        regex = restated(item.nodeid, reasons) if marker is not None else None
        if regex is not None:
            item.add_marker(pytest.mark.fixes(*marker.args, **{**marker.kwargs, "fails_with": regex}), append=False)


def pytest_collection_finish(session: pytest.Session) -> None:
    target = os.environ.get(MARKERS_ENV)
    if not target:
        return
    markers = {}
    for item in session.items:
        marker = item.get_closest_marker("fixes")
        if marker is not None:
            markers[item.nodeid] = {"patch": marker.args[0] if marker.args else None,
                                    "part": marker.kwargs.get("part"), "fails_with": marker.kwargs.get("fails_with")}
    _write_json(Path(target), markers)


def _write_json(path: Path, data: dict) -> None:
    """``data`` as JSON at ``path``, whole or not at all: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".partial")
    staging.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")
    os.replace(staging, path)


def pytest_sessionstart(session: pytest.Session) -> None:
    _records.clear()  # one session's records (pytest run in-process, as the tool tests run it, shares the module)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    marker = item.get_closest_marker("fixes")
    if marker is None or call.when == "teardown" or (call.when == "setup" and call.excinfo is None):
        return report
    _records[item.nodeid] = record(marker, call.when, call.excinfo)
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get(REASONS_ENV)
    if not target:
        return
    _write_json(Path(target), _records)
