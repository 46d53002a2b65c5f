"""The Python style check of `make lint`: ruff, with the repository's ruff.toml.

ruff is pinned in tests/requirements.txt, so `make test` installs it into the test venv
(work/venv) and checks the tree in phase 1 (tests/tool/test_lint.py). `make lint` runs the
same ruff from there, or from PATH; without either it says how to get it and fails.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import DistBuildError

CONFIG = "ruff.toml"
PIN = re.compile(r"^ruff==(?P<version>\S+)", re.MULTILINE)


def pinned_version(repo: Path) -> str:
    requirements = repo / "tests" / "requirements.txt"
    match = PIN.search(requirements.read_text()) if requirements.is_file() else None
    if match is None:
        raise DistBuildError(f"{requirements}: no ruff==<version> pin")
    return match["version"]


def find_ruff(repo: Path, work: Path) -> str:
    beside_python = Path(sys.executable).parent / "ruff"   # the test venv's, when make test runs this
    for candidate in (beside_python, work / "venv" / "bin" / "ruff", shutil.which("ruff")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise DistBuildError(f"ruff is not installed: `make test` installs ruff=={pinned_version(repo)} into "
                         f"{work / 'venv'}, or `python3 -m pip install ruff=={pinned_version(repo)}`")


def style_problems(repo: Path, work: Path) -> list[str]:
    """ruff's findings over the repository, one per line; none when the repository has no ruff.toml."""
    if not (repo / CONFIG).is_file():
        return []
    ruff = find_ruff(repo, work)
    version = subprocess.run([ruff, "--version"], capture_output=True, text=True).stdout.split()[-1:]
    if version != [pinned_version(repo)]:
        raise DistBuildError(f"{ruff} is ruff {' '.join(version) or '(unknown)'}, the pin is "
                             f"{pinned_version(repo)} (tests/requirements.txt): run make test to reinstall it")
    result = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "--quiet", "."],
                            cwd=repo, capture_output=True, text=True)
    if result.returncode not in (0, 1):
        raise DistBuildError(f"ruff failed ({result.returncode}): {result.stderr.strip()[-500:]}")
    return [f"ruff: {line}" for line in result.stdout.splitlines() if line.strip()]
