"""The repository's Python passes ruff with its ruff.toml, the check `make lint` runs
(build/distbuild/style.py), and that check reports what ruff finds."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from distbuild import style
from distbuild.errors import DistBuildError

ROOT = Path(__file__).resolve().parents[2]


def test_the_repository_passes_ruff(tmp_path):
    problems = style.style_problems(ROOT, ROOT / "work")
    assert not problems, "\n".join(problems[:40])


def test_a_finding_is_reported_with_its_file_line_and_rule(tmp_path):
    shutil.copy(ROOT / style.CONFIG, tmp_path / style.CONFIG)
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "requirements.txt", tmp_path / "tests" / "requirements.txt")
    (tmp_path / "bad.py").write_text("import os\nx = 1\n")
    problems = style.style_problems(tmp_path, ROOT / "work")
    assert problems == ["ruff: bad.py:1:8: F401 [*] `os` imported but unused"]


def test_a_repository_without_ruff_toml_is_not_checked(tmp_path):
    (tmp_path / "bad.py").write_text("import os\n")
    assert style.style_problems(tmp_path, tmp_path / "work") == []


def test_without_ruff_the_error_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(style.sys, "executable", str(tmp_path / "python"))
    shutil.copy(ROOT / style.CONFIG, tmp_path / style.CONFIG)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "requirements.txt").write_text("ruff==0.17.5\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(DistBuildError, match=r"ruff is not installed: `make test` installs ruff==0\.17\.5"):
        style.style_problems(tmp_path, tmp_path / "work")
