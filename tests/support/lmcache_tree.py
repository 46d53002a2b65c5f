"""Which LMCache patches the build under test has (``DIST_LMCACHE_TREE``).

``patched`` has the whole series, ``pristine`` none of it, and
``without:<patch>`` (the leave-one-out phase) lacks that patch and the later
ones the series' ``leave-out`` file leaves out with it
(build/distbuild/host/leaveout.py); ``without:<patch>:<part>`` has every patch, one
of them less that part (tests/parts/). A test's own setup or teardown may need a fix
the build lacks (a close that hangs without 0018): it asks here instead of
working around the fix on every tree.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERIES_DIR = ROOT / "patches" / "lmcache"


def _declared_dependents() -> dict[str, tuple[set[str], str]]:
    build = str(ROOT / "build")
    if build not in sys.path:
        sys.path.insert(0, build)
    from distbuild.host.leaveout import declared_dependents

    return declared_dependents(SERIES_DIR)


def has_patch(patch: str) -> bool:
    """Whether the LMCache build under test applies ``patch``."""
    tree = os.environ.get("DIST_LMCACHE_TREE", "patched")
    if tree == "patched":
        return True
    if tree == "pristine":
        return False
    left_out = tree.removeprefix("without:")
    if ":" in left_out:
        return True  # every patch applies; only a part of one is left out
    if patch == left_out:
        return False
    return patch not in _declared_dependents().get(left_out, (set(), ""))[0]
