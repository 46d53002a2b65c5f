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
        reason = f"no FlashInfer tree at {ab.flashinfer_tree()} ({ab.missing_tree_hint()})"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return cuda


def _run(args: list[str], timeout: int) -> str:
    proc = subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"gpu/run.py {' '.join(args)} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    _toolchain()
    tmp = tmp_path_factory.mktemp("bundle")
    bundle = tmp / "bundle"
    _run(["--make-bundle", str(bundle), "--out", str(tmp / "scratch")], timeout=600)
    for name in ("pristine", "patched"):
        assert (bundle / name / ab.DEV_KERNEL).is_file()
    return bundle


@pytest.mark.parametrize("arch", ["sm_103a", "sm_100a", "sm_90a"])
def test_gpu_harness_builds_from_a_bundle(bundle, tmp_path, arch):
    """The libraries every harness case runs, host and device code, for each arch."""
    out = _run(["--bundle", str(bundle), "--build-only", "--arch", arch, "--jobs", str(min(2, os.cpu_count() or 1)),
                "--out", str(tmp_path / "build")], timeout=1200)
    libs = {name: tmp_path / "build" / f"libactivation_{name}_{arch}.so" for name in ("pristine", "patched")}
    assert all(p.is_file() for p in libs.values()), out
    has_mn_limit = {name: ctypes.CDLL(str(p)).dist_activation_has_mn_limit() for name, p in libs.items()}
    assert has_mn_limit == {"pristine": 0, "patched": 1}, has_mn_limit
    part = (tmp_path / "build" / f"patched_{arch}_activation_part.cu").read_text()
    assert (ab.SM90_MIN_CTAS[1] in part) == (arch == "sm_90a")  # the SM90 variant, there only
    for log in (tmp_path / "build").glob("build_*.log"):
        stats = {n: s for n, s in ab.ptxas_stats(log.read_text()).items() if "10activation" in n}
        assert any("DeepSeek" in n for n in stats), f"{log}: no ptxas -v report of the activation kernels"
        assert not [n for n, s in stats.items() if s.get("stack") or s.get("spill_stores")], log


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
        if any(t is not None for t in (case.alpha, case.beta, case.limit)):
            gated = ref.GatedAct(*(None if t is None else t.numpy() for t in (case.alpha, case.beta, case.limit)))
        ref.activation_deepseek(case.inp.numpy().view(storage), case.in_sf.numpy(), case.routing, out,
                                out_sf, case.dtype, gated, rows=rows)
        if self.flip:
            out[case.local_rows[-1], -1] ^= 1


def _harness():
    import numpy as np
    import torch

    sys.path.insert(0, str(RUN.parent))
    try:
        import run as harness
    finally:
        sys.path.remove(str(RUN.parent))
    harness.torch_, harness.np = torch, np
    return harness


@pytest.mark.parametrize("routing,dtype,gated", [("skewed", "e4m3", False), ("random", "e4m3", True),
                                                 ("random", "bf16", False)])
def test_gpu_harness_checks_on_cpu(routing, dtype, gated):
    """run.py's inputs, routing and checks, on CPU tensors with the reference as both kernels."""
    import numpy as np
    import torch

    harness = _harness()
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


def test_case_grid_covers_the_issue():
    """Every token count, width, tile, walk, launch mode and routing kind the patch's correctness
    rests on is a checked case."""
    harness = _harness()
    checks = harness.check_grid()
    shapes = [c.shape for c in checks]
    assert {1, 2, 8, 16, 64, 256, 1024, 8192, 32768, 65536, 131072} <= {s.num_tokens for s in shapes}
    assert {s.width for s in shapes} == {128, 256, 384, 1536, 2048}
    assert {s.width for s in shapes if s.num_tokens == 131072} == {256, 2048}
    assert {c.tile for s in shapes for c in [s] if c.tile} == {8, 16, 32, 64, 128}
    assert {c.pdl for c in checks} == {False, True}
    assert {s.routing for s in shapes} == {"random", "skewed", "local", "remote"}
    assert {s.gated for s in shapes} == {None, "full", "alpha", "beta"}
    assert {s.dtype for s in shapes} == {"e4m3", "bf16", "fp16"}
    assert any(s.local_offset for s in shapes) and any(s.num_local_experts == 256 for s in shapes)
    assert len(set(checks)) == len(checks)
    timings = harness.timing_grid()
    kinds: dict[str, set[int]] = {}
    for t in timings:
        kinds.setdefault(t.kind, set()).add(t.shape.num_tokens)
    assert {1, 2, 8, 16} <= kinds["decode"] and max(kinds["prefill"]) == 131072
    assert {t.shape.width for t in timings if t.kind == "tp8"} == {256} and max(kinds["tp8"]) == 131072
    assert {t.walk for t in timings} == {"rows", "slots"} and any(t.pdl for t in timings)
    assert any(t.shape.tile == 64 for t in timings)


@pytest.mark.parametrize("shape_kwargs", [
    dict(num_tokens=16, width=128), dict(num_tokens=64, width=384), dict(num_tokens=8, width=1536),
    dict(num_tokens=16, routing="remote"), dict(num_tokens=16, width=384, routing="local"),
    dict(num_tokens=64, local_offset=96), dict(num_tokens=64, width=384, local_offset=224, routing="local"),
    dict(num_tokens=64, gated="alpha"), dict(num_tokens=64, width=384, gated="beta"),
    dict(num_tokens=64, width=256, num_local_experts=256), dict(num_tokens=64, tile=16, width=384),
    dict(num_tokens=1, width=256, dtype="fp16"),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_every_case_kind_builds_and_checks_on_cpu(shape_kwargs):
    """Each new case kind: its routing is what it says, and the harness checks pass and catch a flip."""
    import numpy as np
    import torch

    harness = _harness()
    ref = harness.ref
    shape = harness.Shape(**shape_kwargs)
    case = harness.Case(torch, shape, seed=5, device="cpu")
    r = case.routing
    expanded = r.expanded_idx_to_permuted_idx
    local = np.count_nonzero(expanded >= 0)
    if shape.routing == "remote":
        assert local == 0 and case.rows == 0
    elif shape.routing == "local" or shape.num_local_experts == harness.NUM_EXPERTS:
        assert local == expanded.size
    else:
        assert 0 < local < expanded.size
    if shape.tile:
        assert case.tile == shape.tile
    assert (case.alpha is not None) == (shape.gated in ("full", "alpha"))
    assert (case.beta is not None) == (shape.gated in ("full", "beta"))
    assert (case.limit is not None) == (shape.gated == "full")
    results, failures = [], []
    same, refcheck = harness.check_case({"pristine": _ReferenceLibrary(ref), "patched": _ReferenceLibrary(ref)},
                                        case, results, failures, np.random.default_rng(0), 128, shape.label)
    assert all(same.values()) and refcheck["ok"] and not failures, failures
    if shape.routing == "remote":
        assert same == {"rows": True, "slots": True, "untouched": True, "nothing_written": True}
        return
    assert refcheck["exact"] == refcheck["elements"] > 0
    same, _ = harness.check_case({"pristine": _ReferenceLibrary(ref), "patched": _ReferenceLibrary(ref, flip=True)},
                                 case, results, failures, np.random.default_rng(0), 128, "flip")
    assert not same["rows"] and not same["slots"] and len(failures) == 1


def test_a_kernel_that_trusts_unwritten_mn_limits_is_caught_on_cpu():
    """The MN-limit array is as long as FlashInfer's workspace makes it, and the tiles the routing
    leaves unwritten hold a limit that would make every row of them valid: only the total stops a
    kernel there. A stand-in that takes such a tile's first row writes past the total, into rows
    every buffer has and that must stay untouched."""
    import numpy as np
    import torch

    harness = _harness()
    ref = harness.ref
    case = harness.Case(torch, 64, seed=7, device="cpu")
    num_tiles = len(case.routing.cta_idx_xy_to_mn_limit)
    assert case.max_num_ctas == harness.max_num_ctas_in_batch_dim(64, harness.TOP_K, harness.NUM_EXPERTS, case.tile)
    assert len(case.mn_limit) == case.max_num_ctas + 1 and case.max_num_ctas > num_tiles
    assert int(case.mn_limit[num_tiles]) == harness.UNWRITTEN_MN_LIMIT
    assert case.out.shape[0] == case.rows + harness.SLACK_TILES * case.tile

    class TrustsUnwrittenLimits(_ReferenceLibrary):
        def run(self, case, mn_limit=True, pdl=False, stream=0):
            super().run(case, mn_limit, pdl, stream)
            if mn_limit:  # the first row of the first unwritten tile: num_tiles * tile == total
                case.out[num_tiles * case.tile] = 0

    results, failures = [], []
    same, _ = harness.check_case({"pristine": _ReferenceLibrary(ref), "patched": TrustsUnwrittenLimits(ref)},
                                 case, results, failures, np.random.default_rng(0), 64, "past-total")
    assert same["untouched"] is False and same["slots"] and len(failures) == 1
