"""The distribution's real lock file."""
from __future__ import annotations

from pathlib import Path

import pytest

from distbuild.pins import load

PINS = Path(__file__).resolve().parents[2] / "build" / "pins.toml"


def test_lock_pins_every_upstream_and_image_artifact():
    pins = load(PINS)
    by_file = {p.filename: p for p in pins}
    for required in (
        "lmcache-0.5.5.tar.gz",
        "flashinfer_python-0.7.0.post1.tar.gz",
        "vllm-0.31.0.tar.gz",
        "vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "nixl_cu13-1.4.1-cp311-cp311-manylinux_2_28_x86_64.whl",
        "vllm_router-0.1.17-cp38-abi3-manylinux_2_28_x86_64.whl",
        "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    ):
        assert required in by_file, f"{required} is not pinned"
    assert {p.upstream for p in pins if p.upstream} == {"lmcache", "flashinfer", "vllm"}
    assert any(p.name == "nvidia-cuda-nvcc" and p.version.startswith("13.0.") for p in pins)


def test_lock_names_no_host():
    text = PINS.read_text()
    assert "://" not in text and "pypi" not in text.lower()


def test_nixl_is_the_version_vllm_pins_for_its_kv_connectors():
    """vLLM 0.31.0 pins `nixl == 1.4.1` (requirements/kv_connectors.txt): the version its NIXL
    connector was tested with, and the one whose LIBFABRIC plugin needs FABRIC_1.7, which the
    image's libfabric 2.1.0 has (1.5.1's needs FABRIC_1.10, in no libfabric release)."""
    import re
    import tarfile

    from distbuild.paths import Layout

    vllm = next(p for p in load(PINS) if p.name == "vllm" and p.kind == "sdist")
    sdist = Layout.default(repo=PINS.parents[1]).cache / vllm.filename
    if not sdist.is_file():
        pytest.skip(f"{sdist} not fetched (make sources)")
    with tarfile.open(sdist) as tar:
        text = tar.extractfile(f"vllm-{vllm.version}/requirements/kv_connectors.txt").read().decode()
    wanted = re.search(r"^nixl\s*==\s*(\S+)", text, re.M).group(1)
    pinned = {p.name: p.version for p in load(PINS) if p.role == "image"}
    assert pinned["nixl"] == pinned["nixl-cu13"] == wanted
