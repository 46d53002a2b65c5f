"""The link-time libcuda stub (image/imagectl/cudastub.py) from the pinned toolchain's cuda.h.

FlashInfer's JIT links every module with ``-L$cuda_home/lib64/stubs -lcuda``; the toolchain
wheels carry no libcuda, so without the stub such a link fails ("cannot find -lcuda"). The
image-check test builds a real FlashInfer module inside the image; these check the stub itself
with the host's gcc and the same cuda.h.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from imagectl import cudastub

CALLER = r"""
#include <cuda.h>
int probe(void) {
    CUdevice dev;
    CUtensorMap map;
    (void)map;
    if (cuInit(0) != CUDA_SUCCESS) return 1;
    return (int)cuDeviceGet(&dev, 0) + (int)cuLaunchKernelEx(0, 0, 0, 0) + (int)cuCtxCreate(0, 0, 0, dev);
}
"""


@pytest.fixture(scope="module")
def cuda_h() -> Path:
    value = os.environ.get("DIST_CUDA_HOME")
    if not value:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("DIST_CUDA_HOME is not set: the stub is made from the pinned toolchain's cuda.h", pytrace=False)
        pytest.skip("DIST_CUDA_HOME is not set (the pinned toolchain's CUDA home)")
    return Path(value) / "include" / "cuda.h"


def _dynamic(path: Path) -> str:
    return subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout


def _defined(path: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_the_stub_is_a_libcuda_so_1_with_every_driver_entry_point(cuda_h: Path, tmp_path: Path) -> None:
    out = tmp_path / "stubs" / "libcuda.so"
    count = cudastub.build(cuda_h, out)
    assert "Library soname: [libcuda.so.1]" in _dynamic(out)
    assert "(NEEDED)" not in _dynamic(out)   # depends on nothing, not even libc
    names = _defined(out)
    assert len(names) == count > 400
    # the versioned names cuda.h maps to (what compiled code references), and the legacy ones
    for name in ("cuInit", "cuGetProcAddress_v2", "cuLaunchKernelEx", "cuTensorMapEncodeTiled", "cuCtxCreate_v4",
                 "cuMemAlloc_v2", "cuMemcpyHtoD_v2_ptds", "cuMemAlloc"):
        assert name in names, name
    again = tmp_path / "again" / "libcuda.so"
    cudastub.build(cuda_h, again)
    assert again.read_bytes() == out.read_bytes()   # reproducible: no build-id, no timestamps


def test_a_module_calling_the_driver_links_against_it_and_needs_libcuda_so_1(cuda_h: Path, tmp_path: Path) -> None:
    stubs = tmp_path / "stubs"
    cudastub.build(cuda_h, stubs / "libcuda.so")
    src = tmp_path / "probe.c"
    src.write_text(CALLER)
    cmd = ["gcc", "-shared", "-fPIC", f"-I{cuda_h.parent}", str(src), "-Wl,--no-undefined", "-o"]
    linked = subprocess.run([*cmd, str(tmp_path / "probe.so"), f"-L{stubs}", "-lcuda"], capture_output=True, text=True)
    assert linked.returncode == 0, linked.stderr
    assert "Shared library: [libcuda.so.1]" in _dynamic(tmp_path / "probe.so")
    # the link the image made before the stub: FlashInfer's -L.../stubs names a folder with no libcuda
    bare = tmp_path / "empty"
    bare.mkdir()
    failed = subprocess.run([*cmd, str(tmp_path / "bare.so"), f"-L{bare}", "-lcuda"], capture_output=True, text=True)
    assert failed.returncode != 0 and "cannot find -lcuda" in failed.stderr, failed.stderr
    assert not (tmp_path / "bare.so").exists()


def test_a_header_that_is_not_cuda_h_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    fake = tmp_path / "cuda.h"
    fake.write_text("int not_cuda(void);\n")
    out = tmp_path / "stubs" / "libcuda.so"
    with pytest.raises(cudastub.StubError, match=r"cuda.h: only 0 driver entry points found"):
        cudastub.build(fake, out)
    assert not out.exists()
    assert cudastub.main(["--cuda-h", str(tmp_path / "missing.h"), "--out", str(out)]) == 1
    assert not out.exists()
