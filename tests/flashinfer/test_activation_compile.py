"""CI compile check of the fused-MoE activation kernels (FlashInfer patch: DeepSeek FP8
activation kernel that skips remote expert slots).

What it does: compiles ``csrc/fused_moe/trtllm_backend/trtllm_fused_moe_dev_kernel.cu``
with the pinned nvcc (``DIST_CUDA_HOME``) for ``sm_103a`` (B300) and ``sm_100a``, device
code only (``-cubin``), with the nvcc flags FlashInfer's JIT uses for the
``fused_moe_trtllm_sm100`` module (read from the tree's own ``flashinfer/jit`` code, see
``activation_build.jit_nvcc_flags``), and reads ``ptxas -v`` and the PTX:

* the patched tree (``$DIST_WORK/src/flashinfer``, or ``$DIST_FLASHINFER_TREE``; HEAD): the whole file;
* the pristine revision (``refs/dist/pristine``), for comparison: the file up to the end
  of ``namespace activation`` (``activation_build.activation_part``), which holds every
  activation kernel and compiles them exactly as the whole file does.

It fails, with the kernels named, if an activation kernel of the patched file spills or
has a stack frame; writes registers / barriers / shared memory per instantiation, arch
and tree to ``ptxas_report.json`` in the pytest tmp dir and prints the table.

It also proves, from the compiler's output, the parts of the patch that the compiler can
see: the DeepSeek kernel takes no barrier and no shared memory (no block reduction), uses
128-bit global loads and warp shuffles; it is instantiated for every dtype the pristine
kernel was; its set of floating-point instructions is the pristine kernel's (same
approximate division and exp2, same FTZ, same conversions, no fused multiply-add that
the pristine kernel lacks): necessary for bit-identical results, not sufficient (the
order of operations is only checked by a GPU run); and the non-DeepSeek kernel's PTX is
unchanged (compared after renaming registers and labels).

What it does not prove: that the kernels are correct or fast (no GPU runs here; the CPU
reference is tested in test_activation_reference.py, bit-identity and speed by the GPU
harness in gpu/); that the rest of the fused-MoE module compiles: the module's other
files (the runner, the launcher, the batched-GEMM runner) need the trtllm-gen export
headers, which FlashInfer downloads at JIT time and which are not available here. This
file reaches them through DevKernel.h (DtypeDecl.h and SfLayoutDecl.h, and what those
include) and uses two enums from them; ``harness/include`` declares just those
(values arbitrary: they appear only in host-side comparisons and as template arguments
of the scale-layout conversion, never in the activation kernels' device code), and empty
cuBLAS stand-ins replace headers the nvcc wheels lack (included,
unused). Anything else the file used from them would fail to compile here. The SASS is
not inspected beyond ptxas' summary (no cuobjdump in the toolchain).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
from pathlib import Path

import pytest

from tests.flashinfer import activation_build as ab
from tests.flashinfer import ptx_load_depth
from tests.flashinfer.nvcc_cache import REUSED

ARCHS = ("sm_103a", "sm_100a", "sm_90a")
DTYPES = ("float_e4m3_t", "bfloat16_t", "half_t")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _unavailable(reason: str):
    if _in_ci():
        pytest.fail(f"{reason} (CI=true: the compile check must run in CI)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def toolchain():
    cuda = ab.cuda_home()
    if cuda is None:
        _unavailable("DIST_CUDA_HOME is not set to a CUDA toolkit with bin/nvcc "
                     "(the pinned nvcc 13.0: work/toolchain/lib/python3.11/site-packages/nvidia/cu13)")
    try:
        patched = ab.patched_sources()
    except ab.BuildError as exc:
        _unavailable(str(exc))
    return cuda, patched


# nvcc compiles one file on one core: phase 1 of make test runs one test at a time, so the six
# compiles of the builds fixture go two at a time.
COMPILE_JOBS = min(2, os.cpu_count() or 1)


def _compile(cuda, flags, sources, src: Path, arch: str, out: Path) -> tuple[tuple[str, str], dict]:
    """One tree's activation kernels for one arch: ptxas stats and PTX functions."""
    tag = f"{sources.name}-{arch}"
    keep = out / tag
    keep.mkdir()
    log = ab.nvcc(cuda, [*flags.for_arch(arch), *ab.include_flags(sources, cuda),
                         "-cubin", "-Xptxas", "-v", "--keep", f"--keep-dir={keep}",
                         "-o", str(out / f"{tag}.cubin"), str(src)], out / f"{tag}.log")
    stats = {name: s for name, s in ab.ptxas_stats(log).items() if "10activation" in name}
    if not stats:
        pytest.fail(f"{tag}: ptxas -v reported no activation kernels; see {out / (tag + '.log')}")
    return (sources.name, arch), {"stats": stats, "ptx": ab.ptx_functions((keep / f"{src.stem}.ptx").read_text()),
                                  "reused": log.startswith(REUSED)}


@pytest.fixture(scope="module")
def builds(toolchain, tmp_path_factory):
    """(tree, arch) -> {"stats": ptxas stats of activation kernels, "ptx": name -> PTX}."""
    cuda, patched = toolchain
    out = tmp_path_factory.mktemp("activation_compile")
    pristine = ab.pristine_sources(patched.tree, out / "pristine-overlay")
    flags = ab.jit_nvcc_flags(patched.tree)
    pristine_src = out / "pristine_activation_part.cu"
    pristine_src.write_text(ab.activation_part(pristine.text(ab.DEV_KERNEL)))
    compiles = []
    for arch in ARCHS:
        patched_src = patched.path(ab.DEV_KERNEL)
        if arch == "sm_90a":
            # FlashInfer builds the module for SM100/SM103 only; SM90 is the H100/H200 harness's
            # build, of its variant (activation_build.harness_variant), cut like the pristine file.
            patched_src = out / "patched_sm_90a_activation_part.cu"
            patched_src.write_text(ab.harness_variant(ab.activation_part(patched.text(ab.DEV_KERNEL)), arch))
        compiles += [(patched, patched_src, arch), (pristine, pristine_src, arch)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=COMPILE_JOBS) as pool:
        result = dict(pool.map(lambda job: _compile(cuda, flags, *job, out), compiles))
    report = {
        "tree": str(patched.tree),  # the flags were read from this tree's JIT code
        "flags": {arch: flags.for_arch(arch) for arch in ARCHS},
        "kernels": {f"{tree}/{arch}": {ab.short_name(n): s for n, s in sorted(b["stats"].items())}
                    for (tree, arch), b in result.items()},
    }
    (out / "ptxas_report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    result["report_path"] = out / "ptxas_report.json"
    result["sources"] = {"patched": ab.activation_part(patched.text(ab.DEV_KERNEL)),
                         "pristine": pristine_src.read_text()}
    return result


DEEPSEEK_KERNELS = ("activationDeepSeekKernel", "activationDeepSeekSmallBatchKernel")


def _deepseek(build: dict, dtype: str | None = None, kernels: tuple[str, ...] = DEEPSEEK_KERNELS) -> dict[str, dict]:
    """The DeepSeek kernels' instantiations (both of the patched file's by default)."""
    return {n: s for n, s in build["stats"].items()
            if any(f"{len(k)}{k}I" in n for k in kernels) and (dtype is None or f"cutlass{len(dtype)}{dtype}" in n)}


def _table(builds) -> str:
    rows = [("kernel", "arch", "tree", "regs", "barriers", "smem", "stack", "spills")]
    for (tree, arch), build in sorted((k, v) for k, v in builds.items() if isinstance(k, tuple) and len(k) == 2):
        for name, s in sorted(build["stats"].items(), key=lambda kv: ab.short_name(kv[0])):
            if "activationDeepSeekKernel" not in name and tree == "pristine":
                continue  # the non-DeepSeek kernel is unchanged; its patched row suffices
            rows.append((ab.short_name(name), arch, tree, str(s.get("registers")), str(s.get("barriers")),
                         str(s.get("smem")), str(s.get("stack")),
                         f"{s.get('spill_stores')}/{s.get('spill_loads')}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def test_report(builds, capsys):
    """Writes ptxas_report.json and prints registers/smem per instantiation."""
    assert builds["report_path"].is_file()
    with capsys.disabled():
        compiles = [b for k, b in builds.items() if isinstance(k, tuple) and len(k) == 2]
        reused = sum(b["reused"] for b in compiles)
        print(f"\nptxas -v, activation kernels (report: {builds['report_path']}; {len(compiles)} compiles, "
              f"{reused} reused from identical inputs, nvcc_cache.py):\n{_table(builds)}")


@pytest.mark.parametrize("arch", ARCHS)
def test_activation_kernels_do_not_spill(builds, arch):
    bad = [f"{ab.short_name(n)}: stack {s.get('stack')} B, spill stores {s.get('spill_stores')} B, "
           f"spill loads {s.get('spill_loads')} B"
           for n, s in builds[("patched", arch)]["stats"].items()
           if s.get("stack", 1) or s.get("spill_stores", 1) or s.get("spill_loads", 1)]
    assert not bad, (f"activation kernels spill or use a stack frame on {arch} "
                     f"(ptxas -v; a spill costs local-memory traffic on a bandwidth-bound kernel):\n  "
                     + "\n  ".join(bad))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_instantiation_is_kept(builds, arch):
    def kinds(tree, kernel):
        return {(m.group(1), m.group(2)) for n in builds[(tree, arch)]["stats"]
                if kernel in n for m in [re.search(r"cutlass\d+(\w+?)ELi\d+ELb([01])", n)] if m}

    for kernel in ("activationDeepSeekKernel", "activationKernel"):
        missing = kinds("pristine", kernel) - kinds("patched", kernel)
        assert not missing, f"{kernel}: the patched file no longer instantiates {sorted(missing)} on {arch}"
    assert {d for d, _ in kinds("patched", "activationDeepSeekKernel")} == set(DTYPES)
    every = {(d, pdl) for d in DTYPES for pdl in "01"}
    assert kinds("patched", "activationDeepSeekSmallBatchKernel") == every


@pytest.mark.parametrize("arch", ARCHS)
def test_deepseek_kernel_has_no_block_reduction(builds, arch):
    """No barrier and no shared memory: a warp-level max, and remote slots cost no barrier."""
    pristine = _deepseek(builds[("pristine", arch)])
    assert all(s["barriers"] >= 1 for s in pristine.values())  # the contrast: cub::BlockReduce
    for name, s in _deepseek(builds[("patched", arch)]).items():
        body = builds[("patched", arch)]["ptx"][name]
        assert s["barriers"] == 0 and s["smem"] == 0, f"{ab.short_name(name)} on {arch}: {s}"
        assert "bar.sync" not in body and "st.shared" not in body, ab.short_name(name)
        assert "shfl.sync.bfly" in body, f"{ab.short_name(name)}: no warp shuffle for the amax"


@pytest.mark.parametrize("arch", ARCHS)
def test_deepseek_kernel_uses_128bit_accesses(builds, arch):
    for name in _deepseek(builds[("patched", arch)], kernels=DEEPSEEK_KERNELS[:1]):
        body = builds[("patched", arch)]["ptx"][name]
        assert re.search(r"ld\.global(\.\w+)*\.v4\.(u32|b32|f32)", body), f"{ab.short_name(name)}: no 16B loads"
        assert re.search(r"st\.global(\.\w+)*\.v4\.(u32|b32|f32)", body), f"{ab.short_name(name)}: no 16B stores"


@pytest.mark.parametrize("arch", ARCHS)
def test_small_batch_kernel_gives_each_lane_four_elements(builds, arch):
    """The small-batch kernel: one 4-element access per lane and half (32-bit for E4m3, 64-bit for
    the 16-bit types), so a scaling block is a whole warp: no 16B access, a 5-step butterfly."""
    for name in _deepseek(builds[("patched", arch)], kernels=DEEPSEEK_KERNELS[1:]):
        body = builds[("patched", arch)]["ptx"][name]
        assert not re.search(r"(ld|st)\.global(\.\w+)*\.v4\.", body), f"{ab.short_name(name)}: 16B accesses"
        if "float_e4m3" in name:
            assert re.search(r"st\.global(\.\w+)*\.(u32|b32)\s", body), f"{ab.short_name(name)}: no 32-bit store"
        else:
            assert re.search(r"ld\.global(\.\w+)*\.v2\.(u32|b32)", body), f"{ab.short_name(name)}: no 64-bit load"
        assert body.count("shfl.sync.bfly") >= 5, f"{ab.short_name(name)}: fewer than 5 butterfly steps"


@pytest.mark.parametrize("arch", ARCHS)
def test_data_loads_wait_for_no_more_loads_than_pristine(builds, arch):
    """A decode batch is latency-bound: before it reads the FC1 output, a warp of either patched
    kernel waits for no more global loads than the pristine kernel's threads do (two: the index
    and the padded total in parallel, then the data), counted through data and control
    dependences in the PTX (ptx_load_depth). The previous revision of the patch read the MN limit
    only after the total, one round trip more; fixtures/ keeps its PTX, which this check fails."""
    for dtype in DTYPES:
        for pdl in ("0", "1"):
            def depths(tree):
                build = builds[(tree, arch)]
                return {n: ptx_load_depth.data_load_depth(build["ptx"][n]) for n in _deepseek(build, dtype)
                        if re.search(rf"ELb{pdl}E", n)}
            pristine, patched = depths("pristine"), depths("patched")
            assert pristine and len(patched) == 2, (dtype, pdl, list(patched))
            assert set(pristine.values()) == {2}, pristine
            deeper = {ab.short_name(n): d for n, d in patched.items() if d > max(pristine.values())}
            assert not deeper, f"{dtype}, pdl {pdl}, {arch}: data loads deeper than pristine's 2: {deeper}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_deepseek_kernel_float_instructions_match_pristine(builds, arch, dtype):
    def ops(tree):
        build = builds[(tree, arch)]
        return set().union(*(ab.float_ops(build["ptx"][n]) for n in _deepseek(build, dtype)))

    pristine, patched = ops("pristine"), ops("patched")
    assert "div.approx.ftz.f32" in pristine  # -use_fast_math reached the compile
    assert patched == pristine, (f"{dtype} on {arch}: the patched DeepSeek kernel's floating-point "
                                 f"instructions differ from the pristine kernel's: only patched "
                                 f"{sorted(patched - pristine)}, only pristine {sorted(pristine - patched)}")


@pytest.mark.parametrize("arch", ARCHS)
def test_non_deepseek_kernel_is_unchanged(builds, arch):
    pristine, patched = builds[("pristine", arch)]["ptx"], builds[("patched", arch)]["ptx"]
    names = [n for n in pristine if "16activationKernel" in n]
    assert len(names) == 18
    changed = [ab.short_name(n) for n in names
               if n not in patched or ab.normalized_ptx(pristine[n]) != ab.normalized_ptx(patched[n])]
    assert not changed, f"activationKernel PTX changed on {arch}: {changed}"


def test_shipped_kernel_has_no_arch_specific_path(builds):
    """The module FlashInfer ships is built for SM100/SM103: the patch adds no path that only an
    SM90 build would take (the H200 harness's variant lives in activation_build.harness_variant)."""
    patched, pristine = builds["sources"]["patched"], builds["sources"]["pristine"]
    assert patched.count("__CUDA_ARCH__") == pristine.count("__CUDA_ARCH__"), (
        "the patched activation code tests __CUDA_ARCH__ where the pristine code does not")
    assert ab.SM90_MIN_CTAS[0] in patched  # the one line the harness's SM90 variant changes
    assert ab.harness_variant(patched, "sm_100a") == patched == ab.harness_variant(patched, "sm_103a")
