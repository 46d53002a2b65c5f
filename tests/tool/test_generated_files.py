"""The shipped series carry no generated file (what make lint checks on every patch)."""
from __future__ import annotations

from pathlib import Path

import pytest

from distbuild.generated import generated_files

REPO = Path(__file__).resolve().parents[2]
PATCHES = sorted((REPO / "patches").glob("*/*.patch"))


def test_the_tree_has_patches_to_check():
    assert len(PATCHES) >= 24, PATCHES


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_shipped_patch_changes_a_generated_file(patch):
    assert generated_files(patch.read_text(errors="replace")) == []
