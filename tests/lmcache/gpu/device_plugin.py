"""pytest plugin for the GPU machine's run (device_run.sh loads it with -p).

* The gpu tests that build vLLM's own objects are skipped, saying so, when vLLM
  is not importable: the bundle does not carry vLLM (a native build for one
  torch, hundreds of MB), so there they cannot run.
* With --device-require-gpu (device_run.sh passes it except in the CPU
  rehearsal), a gpu test that tests/conftest.py would skip for want of CUDA
  stops the run at collection: on the GPU machine that means the run is
  broken, not that the test does not apply.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# gpu test files whose runs build vLLM 0.31.0's kv_caches / LMCacheConnectorV1
# (tests/lmcache/glm5_lmcache_run.py imports vllm inside the worker).
NEEDS_VLLM = {
    "tests/lmcache/test_glm5_kv_roundtrip.py": "vLLM's LMCacheConnectorV1 and kv_caches (glm5_lmcache_run.py)",
}
SKIP_REASON = "needs vLLM 0.31.0 ({}); the GPU bundle does not carry vLLM"


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def torch_cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.hookimpl(trylast=True)  # after tests/conftest.py has marked the gpu tests it skips
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for rel in NEEDS_VLLM:
        if not (REPO / rel).is_file():
            raise pytest.UsageError(f"device_plugin.NEEDS_VLLM names {rel}, which does not exist")
    if config.getoption("device_require_gpu"):
        no_cuda = [item.nodeid for item in items
                   if any(m.kwargs.get("reason") == "needs a CUDA GPU" for m in item.iter_markers("skip"))]
        if no_cuda:
            raise pytest.UsageError(f"--device-require-gpu: {len(no_cuda)} gpu tests would be skipped for want of "
                                    f"CUDA (torch.cuda.is_available() is False), e.g. {no_cuda[0]}")
    if vllm_importable():
        return
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(REPO).as_posix()
        if rel in NEEDS_VLLM and item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON.format(NEEDS_VLLM[rel])))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device-require-gpu", action="store_true", dest="device_require_gpu",
                     help="a gpu test skipped for want of CUDA is an error (the GPU machine's run)")
