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


def test_isort_is_pinned_to_the_revision_lmcaches_pre_commit_runs():
    from distbuild import upstream_style

    tree = ROOT / "work" / "src" / "lmcache"
    if not (tree / upstream_style.PRE_COMMIT).is_file():
        pytest.skip(f"{tree}: no prepared LMCache tree (make patched)")
    pins = (ROOT / "tests" / "requirements.txt").read_text()
    assert f"isort=={upstream_style.upstream_isort_version(tree)} " in pins


def test_the_lmcache_series_keeps_lmcaches_import_order():
    from distbuild import upstream_style

    tree = ROOT / "work" / "src" / "lmcache"
    if not (tree / upstream_style.PRE_COMMIT).is_file():
        pytest.skip(f"{tree}: no prepared LMCache tree (make patched)")
    assert upstream_style.changed_python_files(tree)
    problems = upstream_style.isort_problems(tree, "lmcache")
    assert not problems, "\n".join(problems)


def test_an_import_out_of_the_upstreams_order_is_named(tmp_path):
    """A throwaway upstream: its pre-commit runs isort, and the series adds a file whose
    imports isort would reorder under the upstream's own settings."""
    import subprocess

    from distbuild import upstream_style
    from distbuild.gitrepo import PRISTINE_REF

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / upstream_style.PRE_COMMIT).write_text(
        "repos:\n- repo: https://github.com/PyCQA/isort\n  rev: 6.0.1\n  hooks:\n  - id: isort\n")
    (tmp_path / ".isort.cfg").write_text("[settings]\nprofile=black\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "pristine")
    git("update-ref", PRISTINE_REF, "HEAD")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "ok.py").write_text("import os\nimport sys\n")
    (tmp_path / "pkg" / "bad.py").write_text("import sys\nimport os\n")
    git("add", "-A")
    git("commit", "-q", "-m", "patch")
    assert upstream_style.upstream_isort_version(tmp_path) == "6.0.1"
    assert upstream_style.isort_problems(tmp_path, "up") == [
        f"isort: up: pkg/bad.py: imports not in up's order (run isort in {tmp_path}, then make export UPSTREAM=up)"]


def test_without_isort_the_error_says_how_to_get_it(tmp_path):
    """A python that lacks isort: the check stops, naming the pin `make test` installs."""
    import subprocess

    from distbuild import upstream_style
    from distbuild.gitrepo import PRISTINE_REF

    (tmp_path / upstream_style.PRE_COMMIT).write_text("repos:\n- repo: https://github.com/PyCQA/isort\n  rev: 6.0.1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "pristine"], cwd=tmp_path, check=True)
    subprocess.run([*git, "update-ref", PRISTINE_REF, "HEAD"], cwd=tmp_path, check=True)
    (tmp_path / "a.py").write_text("import os\n")
    subprocess.run([*git, "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "patch"], cwd=tmp_path, check=True)
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'No module named isort' >&2\nexit 1\n")
    python.chmod(0o755)
    with pytest.raises(DistBuildError, match=r"isort did not run .*installs isort==6\.0\.1"):
        upstream_style.isort_problems(tmp_path, "up", str(python))
