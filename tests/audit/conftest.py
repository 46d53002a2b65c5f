"""Tiny CUDA objects compiled once per session with the pinned nvcc, for the arch audit tests.

``DIST_CUDA_HOME`` names the pinned CUDA home (``make test`` sets it;
``python3 -m distbuild toolchain`` prints it). Without it the tests that need
the compiler skip, except under ``CI=true``, where they fail: CI must prove
the audit on real objects.
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))

KERNEL = """\
extern "C" __global__ void scale(float *x, float a) { x[threadIdx.x] *= a; }
extern "C" void launch(float *x) { scale<<<1, 32>>>(x, 2.0f); }
"""

# file name -> (nvcc output flag, -gencode values)
OBJECTS: dict[str, tuple[str, list[str]]] = {
    "libsm103a.so": ("-shared", ["arch=compute_103a,code=sm_103a"]),
    "libsm100a.so": ("-shared", ["arch=compute_100a,code=sm_100a"]),
    "libsm100f.so": ("-shared", ["arch=compute_100f,code=sm_100f"]),
    "libsm100.so": ("-shared", ["arch=compute_100,code=sm_100"]),
    "libsm90a.so": ("-shared", ["arch=compute_90a,code=sm_90a"]),
    "libptx100.so": ("-shared", ["arch=compute_100,code=compute_100"]),
    "libmixed.so.1": ("-shared", ["arch=compute_90a,code=sm_90a", "arch=compute_100f,code=sm_100f",
                                  "arch=compute_90,code=compute_90"]),
    "sm100f.cubin": ("-cubin", ["arch=compute_100f,code=sm_100f"]),
    "sm100a.cubin": ("-cubin", ["arch=compute_100a,code=sm_100a"]),
    "sm100.cubin": ("-cubin", ["arch=compute_100,code=sm_100"]),
    "sm120.cubin": ("-cubin", ["arch=compute_120,code=sm_120"]),
    "kernels.fatbin": ("-fatbin", ["arch=compute_100a,code=sm_100a", "arch=compute_100a,code=compute_100a"]),
}


@pytest.fixture(scope="session")
def cuda_home() -> Path:
    value = os.environ.get("DIST_CUDA_HOME")
    if not value:
        reason = ("DIST_CUDA_HOME is not set: the arch audit tests compile kernels with the pinned nvcc and read "
                  "them with the pinned cuobjdump (`python3 -m distbuild toolchain` prints the CUDA home)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    home = Path(value)
    missing = [tool for tool in ("nvcc", "cuobjdump") if not (home / "bin" / tool).is_file()]
    if missing:
        pytest.fail(f"DIST_CUDA_HOME={home}: bin/ lacks {', '.join(missing)} (is nvidia-cuda-cuobjdump pinned "
                    "with role toolchain and the toolchain reinstalled?)", pytrace=False)
    return home


@pytest.fixture(scope="session")
def cuobjdump(cuda_home: Path) -> Path:
    return cuda_home / "bin" / "cuobjdump"


def _compile(home: Path, source: Path, out: Path, mode: str, gencodes: list[str]) -> str | None:
    cmd = [str(home / "bin" / "nvcc"), mode, "-o", str(out), str(source)]
    if mode == "-shared":
        cmd += ["-Xcompiler", "-fPIC", "-cudart", "none"]
    for value in gencodes:
        cmd += ["-gencode", value]
    result = subprocess.run(cmd, capture_output=True, text=True)
    return None if result.returncode == 0 else f"{' '.join(cmd)}\n{result.stderr[-2000:]}"


@pytest.fixture(scope="session")
def objects(cuda_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding every object of OBJECTS, compiled in parallel (about 30-60 s on 2 cores)."""
    folder = tmp_path_factory.mktemp("cuda-objects")
    source = folder.parent / "kernel.cu"
    source.write_text(KERNEL)
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        errors = pool.map(lambda item: _compile(cuda_home, source, folder / item[0], *item[1]), OBJECTS.items())
        failures = [e for e in errors if e]
    if failures:
        pytest.fail("nvcc failed:\n" + "\n".join(failures), pytrace=False)
    return folder
