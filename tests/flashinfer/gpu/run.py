#!/usr/bin/env python3
"""GPU harness: FlashInfer's DeepSeek FP8 activation, pristine against patched.

Builds the activation kernels of both FlashInfer revisions for the GPU at hand (sm_90a on
H100/H200, sm_100a on B200, sm_103a on B300), each into its own shared library from
activation_bench.cu, with FlashInfer's JIT flags; runs both on EP8-shaped inputs
(intermediate size 2048 per half, top-k 8, 256 experts of which 32 are local, tokens
2,048 / 16,384 / 32,768, routing random and skewed); checks that the outputs and scales
are bit-identical over the whole buffers (the patched kernel both walking the permuted
rows and walking the expanded slots), that they agree with the CPU reference
(../activation_reference.py), and times both: microseconds per call (L2 flushed before
each call, median), the ratio, and the patched kernel's bandwidth for the bytes it must
move against the GPU's measured copy bandwidth. Also checks the OAI-gated variant, the
bf16/fp16 instantiations and a PDL launch for bit-identity.

Needs PyTorch with CUDA and nvcc (DIST_CUDA_HOME, CUDA_HOME, or nvcc on PATH). Under five
minutes on one GPU (the two builds run in parallel).

Sources, in order of preference:
  --bundle DIR   a bundle made by --make-bundle (for a GPU machine without the trees)
  --work DIR     DIST_WORK layout: DIR/src/flashinfer, a git checkout whose HEAD is the
                 patched tree and whose refs/dist/pristine is the pristine commit
                 (default: $DIST_WORK, else <repo>/work)

Modes:
  run.py                           build, check, time (exit 0 ok, 1 wrong results,
                                   3 performance goals missed; --no-perf-gate: 0)
  run.py --build-only --arch sm_103a --out DIR
                                   build both libraries, no GPU needed
  run.py --make-bundle DIR         copy exactly the files the builds read (found with
                                   nvcc -M) into DIR, about 13 MB; carry DIR to the GPU
                                   machine and pass --bundle DIR
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import activation_build as ab  # noqa: E402
import activation_reference as ref  # noqa: E402

NUM_EXPERTS = 256
NUM_LOCAL_EXPERTS = 32  # EP8
LOCAL_EXPERT_OFFSET = 0
TOP_K = 8
INTERMEDIATE = 2048  # per half: innerDim = 4096
TOKENS = (2048, 16384, 32768)
ROUTINGS = ("random", "skewed")
GOAL_RATIO = 6.8  # at 32,768 tokens (FlashInfer PR #3969: 1572 us -> 230 us on B300)
GOAL_COPY_FRACTION = 0.5
JIT_FILES = ["flashinfer/jit/core.py", "flashinfer/jit/cpp_ext.py", "flashinfer/jit/fused_moe.py",
             "flashinfer/compilation_context.py"]
DTYPE_CODES = {"e4m3": 0, "bf16": 1, "fp16": 2}
OVERLAY_ROOTS = "OVERLAY_ROOTS"


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Sources and builds


def find_cuda() -> Path:
    cuda = ab.cuda_home(("CUDA_HOME", "CUDA_PATH"))
    if cuda is None and shutil.which("nvcc"):
        cuda = Path(shutil.which("nvcc")).resolve().parent.parent
    if cuda is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        cuda = Path("/usr/local/cuda")
    if cuda is None:
        sys.exit("run.py: no nvcc: set DIST_CUDA_HOME or CUDA_HOME, or put nvcc on PATH")
    return cuda


def revisions(args, scratch: Path) -> list[ab.Sources]:
    if args.bundle:
        bundle = Path(args.bundle)
        patched = ab.Sources("patched", bundle / "patched")
        roots = tuple((bundle / "pristine" / OVERLAY_ROOTS).read_text().split())
        return [ab.Sources("pristine", patched.tree, bundle / "pristine", roots), patched]
    if args.work:
        os.environ["DIST_WORK"] = str(args.work)
    patched = ab.patched_sources()
    return [ab.pristine_sources(patched.tree, scratch / "pristine-overlay"), patched]


def _compile_args(sources: ab.Sources, arch: str, cuda: Path, part: Path) -> list[str]:
    flags = ab.jit_nvcc_flags(sources.tree)
    return [*flags.for_arch(arch, ab.nvcc_version(cuda)), *ab.include_flags(sources, cuda),
            f'-DDIST_ACTIVATION_SOURCE="{part}"', str(HERE / "activation_bench.cu")]


def build_one(sources: ab.Sources, arch: str, cuda: Path, out: Path) -> Path:
    part = out / f"{sources.name}_activation_part.cu"
    part.write_text(ab.activation_part(sources.text(ab.DEV_KERNEL)))
    lib = out / f"libactivation_{sources.name}_{arch}.so"
    t0 = time.time()
    # The pip nvcc wheel keeps libcudart_static.a in lib/, where its nvcc.profile does not look.
    libdirs = [f"-L{d}" for d in (cuda / "lib", cuda / "lib64") if d.is_dir()]
    ab.nvcc(cuda, [*_compile_args(sources, arch, cuda, part), *libdirs, "-shared", "-o", str(lib)],
            out / f"build_{sources.name}_{arch}.log", timeout=900)
    log(f"built {lib.name} in {time.time() - t0:.0f} s")
    return lib


def build(revs: list[ab.Sources], arch: str, cuda: Path, out: Path, jobs: int) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {r.name: pool.submit(build_one, r, arch, cuda, out) for r in revs}
        return {name: f.result() for name, f in futures.items()}


def make_bundle(revs: list[ab.Sources], cuda: Path, dest: Path, scratch: Path) -> None:
    """Copy every file of the trees that the builds read.

    dest/patched is a partial tree; dest/pristine holds only what the pristine build reads
    from its overlay (the include roots in which the series changes a header, and the
    kernel source), with the list of those roots in dest/pristine/OVERLAY_ROOTS.
    """
    if dest.exists():
        shutil.rmtree(dest)
    for sources in revs:
        part = scratch / f"{sources.name}_activation_part.cu"
        part.write_text(ab.activation_part(sources.text(ab.DEV_KERNEL)))
        deps_out = ab.nvcc(cuda, [*_compile_args(sources, "sm_100a", cuda, part), "-M"],
                           scratch / f"deps_{sources.name}.log")
        # Make-style "target: dep dep \\" lines; libcu++ headers have no suffix, so keep every
        # path and let the roots below decide.
        deps = {p for p in deps_out.replace("\\\n", " ").split() if not p.endswith(":")}
        roots = [sources.overlay, sources.tree] if sources.overlay is not None else [sources.tree]
        files: dict[str, Path] = {}
        for dep in deps:
            path = Path(dep).resolve()
            for root in roots:
                try:
                    rel = path.relative_to(root.resolve())
                except ValueError:
                    continue
                files.setdefault(str(rel), path)
                break
        if sources.overlay is not None:  # the rest comes from the patched tree
            files = {rel: path for rel, path in files.items()
                     if any(rel.startswith(root + "/") for root in sources.overlay_roots)}
            files[ab.DEV_KERNEL] = sources.path(ab.DEV_KERNEL)
            (dest / sources.name).mkdir(parents=True, exist_ok=True)
            (dest / sources.name / OVERLAY_ROOTS).write_text("\n".join(sources.overlay_roots) + "\n")
        else:
            for rel in [ab.DEV_KERNEL, *JIT_FILES]:
                files[rel] = sources.path(rel)
        for rel, path in files.items():
            target = dest / sources.name / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        size = sum(p.stat().st_size for p in (dest / sources.name).rglob("*") if p.is_file())
        log(f"bundle {dest / sources.name}: {len(files)} files, {size / 1e6:.1f} MB")


class Library:
    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.dist_activation_run.restype = ctypes.c_int
        self.lib.dist_activation_run.argtypes = (
            [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 6
            + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int])
        self.has_mn_limit = bool(self.lib.dist_activation_has_mn_limit())

    def run(self, case: "Case", mn_limit: bool = True, pdl: bool = False, stream: int = 0) -> None:
        err = ctypes.create_string_buffer(512)

        def ptr(t):
            return None if t is None else t.data_ptr()

        rc = self.lib.dist_activation_run(
            DTYPE_CODES[case.dtype], 1, int(pdl), ptr(case.inp), ptr(case.out), ptr(case.in_sf),
            ptr(case.out_sf), 2 * case.intermediate, case.num_tokens, TOP_K, ptr(case.expanded),
            ptr(case.total), ptr(case.alpha), ptr(case.beta), ptr(case.limit), ptr(case.batch_idx),
            case.tile, ptr(case.mn_limit) if mn_limit else None, stream, err, len(err))
        if rc != 0:
            raise RuntimeError(f"activation::run failed ({rc}): {err.value.decode()}")


# ---------------------------------------------------------------------------------------------
# Inputs


class Case:
    """One EP8-shaped input: routing metadata and buffers on the GPU."""

    def __init__(self, torch, num_tokens: int, routing: str, dtype: str = "e4m3", gated: bool = False,
                 seed: int = 0, tile: int | None = None, device: str = "cuda"):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.num_tokens, self.routing_kind, self.dtype = num_tokens, routing, dtype
        self.intermediate = INTERMEDIATE
        topk = self._topk(torch, num_tokens, routing, gen)
        if tile is None:  # computeSelectedTileN's centre: next power of two of the mean, 8..128
            avg = num_tokens * TOP_K / NUM_LOCAL_EXPERTS
            tile = min(128, max(8, 1 << max(0, int(avg - 1).bit_length())))
        self.tile = tile
        self.routing = ref.build_routing(topk.numpy(), LOCAL_EXPERT_OFFSET, NUM_LOCAL_EXPERTS, tile)
        r = self.routing
        self.rows = r.total_num_padded_tokens
        self.local_rows = r.local_rows()
        assert (r.rows_from_mn_limit() == self.local_rows).all()
        self.device = dev = device
        i32 = torch.int32
        self.expanded = torch.from_numpy(r.expanded_idx_to_permuted_idx).to(dev, i32)
        self.total = torch.tensor([self.rows], dtype=i32, device=dev)
        self.mn_limit = torch.from_numpy(r.cta_idx_xy_to_mn_limit).to(dev, i32)
        self.batch_idx = torch.from_numpy(r.cta_idx_xy_to_batch_idx).to(dev, i32)
        rows = max(self.rows, 1)
        inner = 2 * self.intermediate
        nb = self.intermediate // ref.NUM_ELTS_PER_SF
        values = torch.randn(rows, inner, generator=gen) * 3.0
        values[:, : inner // 2] *= torch.rand(rows, 1, generator=gen) * 4  # row-varying ranges
        if dtype == "e4m3":
            self.inp = values.to(torch.float8_e4m3fn).view(torch.uint8).to(dev)
            fill = torch.full((rows, self.intermediate), 0xA5, dtype=torch.uint8)
        else:
            tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
            self.inp = values.to(tdt).view(torch.int16).to(dev)
            fill = torch.full((rows, self.intermediate), 0x1A5, dtype=torch.int16)
        self.in_sf = torch.exp2(torch.rand(2 * nb * rows, generator=gen) * 8 - 12).to(dev)
        self.out = fill.to(dev)
        self.out_sf = torch.full((nb * rows,), -1234.5, dtype=torch.float32, device=dev)
        self.alpha = self.beta = self.limit = None
        if gated:
            self.alpha = (torch.rand(NUM_LOCAL_EXPERTS, generator=gen) + 0.8).to(dev)
            self.beta = (torch.rand(NUM_LOCAL_EXPERTS, generator=gen) - 0.5).to(dev)
            self.limit = (torch.rand(NUM_LOCAL_EXPERTS, generator=gen) * 4 + 1).to(dev)
        self.fill_out, self.fill_sf = self.out.clone(), self.out_sf.clone()

    @staticmethod
    def _topk(torch, num_tokens, routing, gen):
        scores = torch.rand(num_tokens, NUM_EXPERTS, generator=gen)
        if routing == "skewed":
            # Zipf-like popularity (weight 1/rank^1.2, ranks shuffled over the experts),
            # sampled without replacement by Gumbel-top-k.
            rank = torch.randperm(NUM_EXPERTS, generator=gen).float() + 1
            gumbel = -torch.log(-torch.log(scores.clamp_min(1e-12)))
            scores = -1.2 * torch.log(rank) + gumbel
        return scores.topk(TOP_K, dim=1).indices.to(torch.int32)

    def reset(self):
        self.out.copy_(self.fill_out)
        self.out_sf.copy_(self.fill_sf)

    def outputs(self):
        return self.out.clone(), self.out_sf.clone()

    def bytes_moved(self) -> int:
        """What the kernel must read and write for the local rows."""
        es = 1 if self.dtype == "e4m3" else 2
        nb = self.intermediate // ref.NUM_ELTS_PER_SF
        per_row = 2 * self.intermediate * es + 2 * nb * 4 + self.intermediate * es + nb * 4
        return len(self.local_rows) * per_row

    def reference_check(self, out, out_sf, max_rows: int, gen) -> dict:
        """The CPU reference on (a sample of) the local rows."""
        rows = self.local_rows
        if len(rows) > max_rows:
            pick = gen.choice(len(rows), size=max_rows - 2, replace=False)
            rows = np.unique(np.concatenate([rows[pick], rows[:1], rows[-1:]]))
        if len(rows) == 0:
            return {"ok": True, "elements": 0}
        nb = self.intermediate // ref.NUM_ELTS_PER_SF
        idx = torch_.from_numpy(rows).to(self.device, torch_.long)
        inp = self.inp[idx].cpu().numpy().view(ref.DTYPES[self.dtype][0])
        in_sf = self.in_sf[: 2 * nb * self.rows].view(2 * nb, self.rows)[:, idx].T.cpu().numpy()
        gated = None
        if self.alpha is not None:
            expert = self.routing.cta_idx_xy_to_batch_idx[rows // self.tile]
            gated = ref.GatedAct(self.alpha.cpu().numpy()[expert], self.beta.cpu().numpy()[expert],
                                 self.limit.cpu().numpy()[expert])
        q_ref, sf_ref = ref.activate_rows(inp, in_sf, self.dtype, gated)
        q_gpu = out[idx].cpu().numpy().view(ref.DTYPES[self.dtype][0])
        sf_gpu = out_sf[: nb * self.rows].view(nb, self.rows)[:, idx].T.cpu().numpy()
        return ref.compare_with_kernel(q_gpu, sf_gpu, q_ref, sf_ref, dtype=self.dtype)


# ---------------------------------------------------------------------------------------------
# Checks and timing


def identical(a, b) -> bool:
    return all(torch_.equal(x.view(torch_.uint8) if x.dtype != torch_.float32 else x.view(torch_.int32),
                            y.view(torch_.uint8) if y.dtype != torch_.float32 else y.view(torch_.int32))
               for x, y in zip(a, b))


def time_us(fn, iters: int, flush) -> float:
    start, end = torch_.cuda.Event(enable_timing=True), torch_.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        flush.zero_()  # evict the inputs from L2: the FC1 output is not resident in production
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def copy_bandwidth(size: int, iters: int = 10) -> float:
    src = torch_.empty(size, dtype=torch_.uint8, device="cuda")
    dst = torch_.empty_like(src)
    start, end = torch_.cuda.Event(enable_timing=True), torch_.cuda.Event(enable_timing=True)
    dst.copy_(src)
    samples = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    return 2 * size / statistics.median(samples)


def detect_arch() -> str:
    major, minor = torch_.cuda.get_device_capability()
    suffix = "a" if major >= 9 else ""
    return f"sm_{major}{minor}{suffix}"


def check_case(libs, case: Case, results: list, failures: list, gen, max_rows: int, label: str,
               pdl: bool = False) -> tuple:
    pristine, patched = libs["pristine"], libs["patched"]
    case.reset()
    pristine.run(case, pdl=pdl)
    want = case.outputs()
    got = {}
    for mode in ("rows", "slots"):
        case.reset()
        patched.run(case, mn_limit=mode == "rows", pdl=pdl)
        got[mode] = case.outputs()
    if case.device != "cpu":
        torch_.cuda.synchronize()
    same = {mode: identical(want, out) for mode, out in got.items()}
    refcheck = case.reference_check(*got["rows"], max_rows, gen)
    untouched = np.setdiff1d(np.arange(case.rows), case.local_rows)
    if len(untouched):
        idx = torch_.from_numpy(untouched).to(case.device, torch_.long)
        same["untouched"] = bool(torch_.equal(got["rows"][0][idx], case.fill_out[idx]))
    ok = all(same.values()) and refcheck["ok"]
    if not ok:
        failures.append(f"{label}: bit-identical {same}, reference {refcheck}")
    results.append({"case": label, "local_rows": int(len(case.local_rows)), "padded_rows": case.rows,
                    "tile": case.tile, "bit_identical": same, "reference": refcheck})
    return same, refcheck


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", help="DIST_WORK directory (holds src/flashinfer)")
    p.add_argument("--bundle", help="a directory made by --make-bundle")
    p.add_argument("--make-bundle", metavar="DIR")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--arch", help="sm_90a, sm_100a, sm_103a (default: the GPU's)")
    p.add_argument("--out", default=None, help="build directory (default: a temporary one)")
    p.add_argument("--jobs", type=int, default=2, help="parallel nvcc builds")
    p.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--ref-rows", type=int, default=2048, help="rows per case checked against the CPU reference")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--no-perf-gate", action="store_true", help="report the goals but exit 0 if missed")
    args = p.parse_args(argv)

    import tempfile
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="dist-activation-"))
    out.mkdir(parents=True, exist_ok=True)
    cuda = find_cuda()
    revs = revisions(args, out)

    if args.make_bundle:
        make_bundle(revs, cuda, Path(args.make_bundle), out)
        return 0
    if args.build_only:
        if not args.arch:
            sys.exit("run.py --build-only: pass --arch (sm_90a, sm_100a or sm_103a)")
        libs = build(revs, args.arch, cuda, out, args.jobs)
        for name, lib in libs.items():
            log(f"{name}: {lib}")
        return 0

    global torch_, np
    import numpy as np
    import torch as torch_

    if not torch_.cuda.is_available():
        sys.exit("run.py: no CUDA GPU visible to PyTorch (use --build-only to only build)")
    arch = args.arch or detect_arch()
    props = torch_.cuda.get_device_properties(0)
    log(f"GPU: {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB, "
        f"arch {arch}; nvcc {cuda}")
    t_start = time.time()
    libs = {name: Library(path) for name, path in build(revs, arch, cuda, out, args.jobs).items()}
    if libs["pristine"].has_mn_limit or not libs["patched"].has_mn_limit:
        log("note: the 'patched' library does not take MN limits: is the patch applied to the tree?")
    gen = np.random.default_rng(0)
    flush = torch_.empty(max(2 * props.L2_cache_size, 64 << 20), dtype=torch_.uint8, device="cuda")
    copy_bw = copy_bandwidth(1 << 30)
    log(f"copy bandwidth (1 GiB device-to-device, read + write): {copy_bw / 1e9:.0f} GB/s")

    results, failures, timings = [], [], []
    header = (f"{'tokens':>7} {'routing':>7} {'rows':>6} {'pristine us':>12} {'patched us':>11} "
              f"{'ratio':>6} {'GB/s':>6} {'%copy':>6}  bit-identical  reference")
    log(header)
    for num_tokens in args.tokens:
        for routing in ROUTINGS:
            case = Case(torch_, num_tokens, routing, seed=num_tokens + (routing == "skewed"))
            same, refcheck = check_case(libs, case, results, failures, gen, args.ref_rows,
                                        f"{num_tokens}/{routing}")
            t_pri = time_us(lambda: libs["pristine"].run(case), args.iters, flush)
            t_pat = time_us(lambda: libs["patched"].run(case), args.iters, flush)
            bw = case.bytes_moved() / (t_pat * 1e-6)
            timings.append({"tokens": num_tokens, "routing": routing, "pristine_us": t_pri,
                            "patched_us": t_pat, "ratio": t_pri / t_pat, "patched_GBps": bw / 1e9,
                            "copy_fraction": bw / copy_bw, "bytes": case.bytes_moved()})
            ident = "yes" if all(same.values()) else f"NO {same}"
            refs = (f"ok ({refcheck['exact']}/{refcheck['elements']} exact, {refcheck['one_step']} one step)"
                    if refcheck["ok"] else f"FAIL {refcheck}")
            log(f"{num_tokens:>7} {routing:>7} {len(case.local_rows):>6} {t_pri:>12.1f} {t_pat:>11.1f} "
                f"{t_pri / t_pat:>6.2f} {bw / 1e9:>6.0f} {100 * bw / copy_bw:>5.0f}%  {ident:<13}  {refs}")
            del case

    extra = [("2048/random/gated", dict(gated=True)), ("2048/random/bf16", dict(dtype="bf16")),
             ("2048/random/fp16", dict(dtype="fp16"))]
    for label, kwargs in extra:
        case = Case(torch_, 2048, "random", seed=7, **kwargs)
        same, refcheck = check_case(libs, case, results, failures, gen, args.ref_rows, label)
        log(f"{label}: bit-identical {all(same.values())}, reference {'ok' if refcheck['ok'] else refcheck}")
    case = Case(torch_, 2048, "skewed", seed=11)
    same, refcheck = check_case(libs, case, results, failures, gen, args.ref_rows, "2048/skewed/pdl", pdl=True)
    log(f"2048/skewed/pdl: bit-identical {all(same.values())}")

    goals = []
    for t in timings:
        if t["tokens"] == 32768:
            goals.append((f"ratio >= {GOAL_RATIO} at 32768/{t['routing']}", t["ratio"] >= GOAL_RATIO,
                          f"{t['ratio']:.2f}"))
            goals.append((f"patched >= {GOAL_COPY_FRACTION:.0%} of copy bandwidth at 32768/{t['routing']}",
                          t["copy_fraction"] >= GOAL_COPY_FRACTION, f"{t['copy_fraction']:.0%}"))
    for name, met, value in goals:
        log(f"goal {'met   ' if met else 'MISSED'} {name}: {value}")
    log(f"done in {time.time() - t_start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": props.name, "arch": arch, "copy_GBps": copy_bw / 1e9,
                                               "timings": timings, "checks": results, "failures": failures,
                                               "goals": goals}, indent=2, default=str))
    if failures:
        log("WRONG RESULTS:\n  " + "\n  ".join(failures))
        return 1
    if not args.no_perf_gate and not all(met for _, met, _ in goals):
        return 3
    return 0


torch_ = None
np = None

if __name__ == "__main__":
    sys.exit(main())
