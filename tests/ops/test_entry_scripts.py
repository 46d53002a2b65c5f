"""The entry scripts: executable, help with an example, clear error without dependencies."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
TOOLS = ["replay", "valkey-stats", "needle", "profile-capture", "cellsim"]


@pytest.mark.parametrize("tool", TOOLS)
def test_script_is_executable_and_its_help_has_an_example(tool):
    script = SCRIPTS / tool
    assert script.read_text().startswith("#!/usr/bin/env python3\n")
    assert os.access(script, os.X_OK)
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "example" in done.stdout and f"scripts/{tool}" in done.stdout


def test_requirements_are_pinned():
    lines = [line for line in (SCRIPTS / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines and all("==" in line for line in lines)


def test_a_missing_dependency_is_named_with_the_fix(tmp_path):
    # a sitecustomize that hides aiohttp, as on a machine without the tools' requirements
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'aiohttp':\n"
        "            raise ModuleNotFoundError(\"No module named 'aiohttp'\", name='aiohttp')\n"
        "sys.meta_path.insert(0, Hide())\n"
    )
    stream = tmp_path / "s.jsonl"
    stream.write_text('{"offset_s": 0, "prompt": "a", "max_tokens": 1}\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, str(SCRIPTS / "replay"), "run", str(stream), "--url", "http://127.0.0.1:1",
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert "the Python package 'aiohttp' is missing" in done.stderr
    assert "requirements.txt" in done.stderr
