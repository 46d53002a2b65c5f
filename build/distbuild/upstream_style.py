"""The series' Python in the upstream's own import order: isort with the upstream tree's own
settings (LMCache's ``.isort.cfg``), at the version the upstream's pre-commit pins.

A maintainer's pre-commit rejects a pull request whose imports isort would reorder, so
`make lint` runs the same check on every Python file the series adds or changes, in the
prepared tree (work/src/<upstream>). isort is pinned in tests/requirements.txt to the
upstream's pre-commit revision, and a test holds the two equal.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .errors import DistBuildError
from .gitrepo import PRISTINE_REF, Repo

PRE_COMMIT = ".pre-commit-config.yaml"
ISORT_REV = re.compile(r"repo:\s*https://github\.com/PyCQA/isort\s*\n\s*rev:\s*v?(?P<rev>\S+)")
UNSORTED = re.compile(r"^ERROR: (?P<path>.+?) Imports are incorrectly sorted", re.MULTILINE)


def upstream_isort_version(tree: Path) -> str | None:
    """The isort revision the upstream's pre-commit runs, or None when it runs none."""
    config = tree / PRE_COMMIT
    match = ISORT_REV.search(config.read_text()) if config.is_file() else None
    return match["rev"] if match else None


def changed_python_files(tree: Path) -> list[str]:
    """The Python files the series adds or changes, relative to the tree."""
    return Repo(tree).out("diff", "--name-only", "--diff-filter=AM", PRISTINE_REF, "HEAD", "--", "*.py").split()


def isort_problems(tree: Path, upstream: str, python: str = sys.executable) -> list[str]:
    """One line per file of the series that the upstream's isort would reorder (``python`` runs
    isort); none when the upstream runs no isort or the tree is not prepared."""
    if upstream_isort_version(tree) is None or Repo(tree).ref(PRISTINE_REF) is None:
        return []
    files = changed_python_files(tree)
    if not files:
        return []
    result = subprocess.run([python, "-m", "isort", "--check-only", "--settings-path", str(tree), *files],
                            cwd=tree, capture_output=True, text=True)
    if result.returncode not in (0, 1) or "No module named isort" in result.stderr:
        raise DistBuildError(f"isort did not run ({result.returncode}): {result.stderr.strip()[-300:]} "
                             f"(`make test` installs isort=={upstream_isort_version(tree)} into work/venv)")
    return [f"isort: {upstream}: {_relative(m['path'], tree)}: imports not in {upstream}'s order "
            f"(run isort in {tree}, then make export UPSTREAM={upstream})"
            for m in UNSORTED.finditer(result.stderr + result.stdout)]


def _relative(path: str, tree: Path) -> str:
    return str(Path(path).relative_to(tree)) if Path(path).is_absolute() else path
