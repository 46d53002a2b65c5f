"""The GPU harness of the DeepSeek FP8 activation patch (gpu/run.py, gpu/activation_bench.cu).

On CPU: proves the harness builds. It makes a source bundle from the trees (the files the
build reads, found with nvcc -M; what one carries to a GPU machine that lacks the trees),
then builds both libraries from that bundle, host and device code, for sm_103a with
FlashInfer's JIT flags, exactly as run.py does on a GPU, and loads them: the pristine
library must not take the routing's MN limits and the patched one must (so each library
holds the revision it claims). It does not run a kernel.

Also on CPU: run.py's inputs, routing metadata and checks, with the CPU reference standing
in for both kernels (the checks pass, and a one-bit difference is caught).

On a GPU (``@pytest.mark.gpu``, skipped elsewhere): runs the harness end to end: bit-
identity of the pristine and patched kernels, agreement with the CPU reference, timings
and the performance goals of the issue (see gpu/run.py).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flashinfer import activation_build as ab

RUN = Path(__file__).resolve().parent / "gpu" / "run.py"


def _toolchain(extra_env: tuple[str, ...] = ()) -> Path:
    cuda = ab.cuda_home(extra_env)
    if cuda is None:
        reason = "DIST_CUDA_HOME is not set to a CUDA toolkit with bin/nvcc"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason} (CI=true: the harness build check must run in CI)", pytrace=False)
        pytest.skip(reason)
    if not (ab.flashinfer_tree() / ab.DEV_KERNEL).is_file():
        reason = f"no FlashInfer tree at {ab.flashinfer_tree()} (set DIST_WORK, or run `make patched`)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return cuda


def _run(args: list[str], timeout: int) -> str:
    proc = subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"gpu/run.py {' '.join(args)} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def test_gpu_harness_builds_from_a_bundle(tmp_path):
    _toolchain()
    bundle = tmp_path / "bundle"
    _run(["--make-bundle", str(bundle), "--out", str(tmp_path / "scratch")], timeout=600)
    for name in ("pristine", "patched"):
        assert (bundle / name / ab.DEV_KERNEL).is_file()
    out = _run(["--bundle", str(bundle), "--build-only", "--arch", "sm_103a", "--jobs", "1",
                "--out", str(tmp_path / "build")], timeout=1200)
    libs = {name: tmp_path / "build" / f"libactivation_{name}_sm_103a.so" for name in ("pristine", "patched")}
    assert all(p.is_file() for p in libs.values()), out
    has_mn_limit = {name: ctypes.CDLL(str(p)).dist_activation_has_mn_limit() for name, p in libs.items()}
    assert has_mn_limit == {"pristine": 0, "patched": 1}, has_mn_limit


@pytest.mark.gpu
def test_gpu_harness(tmp_path):
    _toolchain(("CUDA_HOME", "CUDA_PATH"))
    out = _run(["--out", str(tmp_path / "build"), "--json", str(tmp_path / "results.json")], timeout=600)
    print(out)


class _ReferenceLibrary:
    """Stands in for a built library on CPU: runs the reference on the case's buffers.

    ``flip`` corrupts one output byte, to show the harness notices a one-bit difference.
    """

    has_mn_limit = True

    def __init__(self, ref, flip: bool = False):
        self.ref, self.flip = ref, flip

    def run(self, case, mn_limit=True, pdl=False, stream=0):
        ref = self.ref
        storage = ref.DTYPES[case.dtype][0]
        nb = case.intermediate // ref.NUM_ELTS_PER_SF
        out = case.out.numpy().view(storage).reshape(-1, case.intermediate)
        out_sf = case.out_sf.numpy()[: nb * case.rows].reshape(nb, case.rows)
        rows = case.routing.rows_from_mn_limit() if mn_limit else case.routing.local_rows()
        gated = None
        if case.alpha is not None:
            gated = ref.GatedAct(case.alpha.numpy(), case.beta.numpy(), case.limit.numpy())
        ref.activation_deepseek(case.inp.numpy().view(storage), case.in_sf.numpy(), case.routing, out,
                                out_sf, case.dtype, gated, rows=rows)
        if self.flip:
            out[case.local_rows[-1], -1] ^= 1


@pytest.mark.parametrize("routing,dtype,gated", [("skewed", "e4m3", False), ("random", "e4m3", True),
                                                 ("random", "bf16", False)])
def test_gpu_harness_checks_on_cpu(routing, dtype, gated):
    """run.py's inputs, routing and checks, on CPU tensors with the reference as both kernels."""
    import numpy as np
    import torch

    sys.path.insert(0, str(RUN.parent))
    try:
        import run as harness
    finally:
        sys.path.remove(str(RUN.parent))
    harness.torch_, harness.np = torch, np
    ref = harness.ref
    case = harness.Case(torch, 512, routing, dtype=dtype, gated=gated, seed=3, device="cpu")
    assert len(case.local_rows) > 0 and case.rows > len(case.local_rows)  # there is padding
    results, failures = [], []
    same, refcheck = harness.check_case({"pristine": _ReferenceLibrary(ref), "patched": _ReferenceLibrary(ref)},
                                        case, results, failures, np.random.default_rng(0), 256, "cpu")
    assert same == {"rows": True, "slots": True, "untouched": True} and refcheck["ok"], failures
    assert refcheck["exact"] == refcheck["elements"] > 0
    same, _ = harness.check_case({"pristine": _ReferenceLibrary(ref), "patched": _ReferenceLibrary(ref, flip=True)},
                                 case, results, failures, np.random.default_rng(0), 256, "cpu-flip")
    assert not same["rows"] and not same["slots"] and len(failures) == 1
