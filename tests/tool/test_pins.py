"""The distribution's real lock file."""
from __future__ import annotations

from pathlib import Path

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
        "nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl",
        "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    ):
        assert required in by_file, f"{required} is not pinned"
    assert {p.upstream for p in pins if p.upstream} == {"lmcache", "flashinfer", "vllm"}
    assert any(p.name == "nvidia-cuda-nvcc" and p.version.startswith("13.0.") for p in pins)


def test_lock_names_no_host():
    text = PINS.read_text()
    assert "://" not in text and "pypi" not in text.lower()
