"""The install files of tests/configs: exact versions, and the vLLM wheel the build pins."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.parametrize("name", ["requirements.txt", "requirements-vllm.txt"])
def test_requirements_are_exact(name):
    lines = [x.strip() for x in (HERE / name).read_text().splitlines() if x.strip() and not x.startswith("#")]
    assert lines
    for line in lines:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", line), f"{name}: {line!r} is not an exact pin"


def test_requirements_vllm_states_the_install_commands():
    text = (HERE / "requirements-vllm.txt").read_text()
    assert "pip install --no-deps work/cache/vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl" in text
    assert "pip install --no-deps -r tests/configs/requirements-vllm.txt" in text
