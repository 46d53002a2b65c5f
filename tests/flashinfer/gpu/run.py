#!/usr/bin/env python3
"""GPU harness: FlashInfer's DeepSeek FP8 activation, pristine against patched.

Builds the activation kernels of both FlashInfer revisions for the GPU at hand (sm_90a on
H100/H200, sm_100a on B200, sm_103a on B300), each into its own shared library from
activation_bench.cu, with FlashInfer's JIT flags (for sm_90a, the patched kernel as the
harness's SM90 variant: activation_build.harness_variant). Then:

* check_grid: bit-identity of pristine and patched on every case kind the patch's correctness rests on (tokens 1
  to 131,072, output widths 128 to 2,048, tiles 8 to 128, rows and slots walks, PDL on and
  off, all-local and all-remote routing, nonzero expert offsets, gated with all controls,
  alpha only and beta only, bf16/fp16, TP8), the outputs and scales over the whole buffers,
  untouched rows untouched, and agreement with the CPU reference (../activation_reference.py)
  on a sample of rows;
* timing_grid: the serving shapes (decode <= 16 tokens EP8, TP8 width 256, prefill up to
  131,072 tokens, tile 64, the slots walk, PDL): microseconds per call (L2 flushed before each
  call, median), the pristine/patched ratio, and the patched kernel's bandwidth for the bytes
  it must move against the GPU's measured copy bandwidth.

Every result records the GPU, the nvcc release and, off B300, that a comparison with B300
figures is across devices. Needs PyTorch with CUDA and nvcc (DIST_CUDA_HOME, CUDA_HOME, or
nvcc on PATH). About three minutes on one H200 (the two builds run in parallel).

Sources, in order of preference:
  --bundle DIR   a bundle made by --make-bundle (for a GPU machine without the trees)
  --work DIR     DIST_WORK layout: DIR/src/flashinfer, a git checkout whose HEAD is the
                 patched tree and whose refs/dist/pristine is the pristine commit
                 (default: $DIST_WORK, else <repo>/work)

Modes:
  run.py [--json F] [--png F]      build, check, time (exit 0 ok, 1 wrong results,
                                   3 a shape slower than pristine or a goal missed;
                                   --no-perf-gate: 0; 2 no GPU visible or no nvcc,
                                   with the JSON's verdict saying which)
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
import subprocess
import sys
import time
from dataclasses import dataclass
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


NO_NVCC = "no nvcc: set DIST_CUDA_HOME or CUDA_HOME, or put nvcc on PATH"


def locate_cuda() -> Path | None:
    cuda = ab.cuda_home(("CUDA_HOME", "CUDA_PATH"))
    if cuda is None and shutil.which("nvcc"):
        cuda = Path(shutil.which("nvcc")).resolve().parent.parent
    if cuda is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        cuda = Path("/usr/local/cuda")
    return cuda


def find_cuda() -> Path:
    cuda = locate_cuda()
    if cuda is None:
        sys.exit(f"run.py: {NO_NVCC}")
    return cuda


def unfit(json_path: str | None, reason: str) -> int:
    """A machine that cannot run the harness (no GPU visible, no nvcc): the results JSON says
    why, with stage "unfit", and the exit status is 2, never 1 (wrong results)."""
    log(f"run.py: UNFIT: {reason}")
    if json_path:
        Progress(Path(json_path), {"verdict": f"unfit: {reason}"}).save("unfit")
    return 2


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
    part = out / f"{sources.name}_{arch}_activation_part.cu"
    part.write_text(ab.harness_variant(ab.activation_part(sources.text(ab.DEV_KERNEL)), arch))
    lib = out / f"libactivation_{sources.name}_{arch}.so"
    t0 = time.time()
    # The pip nvcc wheel keeps libcudart_static.a in lib/, where its nvcc.profile does not look.
    libdirs = [f"-L{d}" for d in (cuda / "lib", cuda / "lib64") if d.is_dir()]
    ab.nvcc(cuda, [*_compile_args(sources, arch, cuda, part), *libdirs, "-Xptxas", "-v", "-shared", "-o", str(lib)],
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
            + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int])
        self.has_mn_limit = bool(self.lib.dist_activation_has_mn_limit())
        self.has_max_num_ctas = bool(self.lib.dist_activation_has_max_num_ctas())

    def run(self, case: "Case", mn_limit: bool = True, pdl: bool = False, stream: int = 0) -> None:
        err = ctypes.create_string_buffer(512)

        def ptr(t):
            return None if t is None else t.data_ptr()

        rc = self.lib.dist_activation_run(
            DTYPE_CODES[case.dtype], 1, int(pdl), ptr(case.inp), ptr(case.out), ptr(case.in_sf),
            ptr(case.out_sf), 2 * case.intermediate, case.num_tokens, TOP_K, ptr(case.expanded),
            ptr(case.total), ptr(case.alpha), ptr(case.beta), ptr(case.limit), ptr(case.batch_idx),
            case.tile, ptr(case.mn_limit) if mn_limit else None, case.max_num_ctas, stream, err, len(err))
        if rc != 0:
            raise RuntimeError(f"activation::run failed ({rc}): {err.value.decode()}")


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Shape:
    """One input kind: the routing and buffers a case is built from."""

    num_tokens: int
    width: int = INTERMEDIATE  # output width: innerDim / 2
    routing: str = "random"  # random, skewed, local (every slot local), remote (none local)
    dtype: str = "e4m3"
    gated: str | None = None  # None, "full" (alpha, beta, clamp), "alpha", "beta"
    tile: int | None = None  # None: computeSelectedTileN's centre for the shape
    num_local_experts: int = NUM_LOCAL_EXPERTS
    local_offset: int = LOCAL_EXPERT_OFFSET

    @property
    def label(self) -> str:
        parts = [f"{self.num_tokens}", f"w{self.width}", self.routing]
        if self.num_local_experts == NUM_EXPERTS:
            parts.append("tp8")
        if self.local_offset:
            parts.append(f"off{self.local_offset}")
        if self.tile is not None:
            parts.append(f"tile{self.tile}")
        if self.dtype != "e4m3":
            parts.append(self.dtype)
        if self.gated:
            parts.append(f"gated-{self.gated}")
        return "/".join(parts)


def max_num_ctas_in_batch_dim(num_tokens: int, top_k: int, num_experts: int, tile: int) -> int:
    """The length FlashInfer's launcher gives the MN-limit array (Routing::getMaxNumCtasInBatchDim):
    one tile per expert while slots last, then one per further whole tile of slots."""
    slots = num_tokens * top_k
    filled = min(num_experts, slots)
    return filled + (slots - filled) // tile


# The MN limits of the tiles the routing does not write, and the rows past the total in every
# buffer: a kernel that trusted such a limit without the total would write those rows.
UNWRITTEN_MN_LIMIT = 0x7FFFFFFF
SLACK_TILES = 2


def default_tile(num_tokens: int, num_local_experts: int) -> int:
    """computeSelectedTileN's centre: next power of two of the mean rows per expert, 8..128."""
    avg = num_tokens * TOP_K / num_local_experts
    return min(128, max(8, 1 << max(0, int(avg - 1).bit_length())))


class Case:
    """One input on the device: routing metadata and buffers."""

    def __init__(self, torch, num_tokens: int | Shape, routing: str = "random", dtype: str = "e4m3",
                 gated: bool | str | None = None, seed: int = 0, tile: int | None = None,
                 device: str = "cuda", **shape_kwargs):
        if isinstance(num_tokens, Shape):
            shape = num_tokens
        else:
            shape = Shape(num_tokens, routing=routing, dtype=dtype, tile=tile,
                          gated="full" if gated is True else (gated or None), **shape_kwargs)
        self.shape = shape
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.num_tokens, self.routing_kind, self.dtype = shape.num_tokens, shape.routing, shape.dtype
        self.intermediate = shape.width
        self.num_local_experts = shape.num_local_experts
        topk = self._topk(torch, shape, gen)
        self.tile = shape.tile or default_tile(shape.num_tokens, shape.num_local_experts)
        self.routing = ref.build_routing(topk.numpy(), shape.local_offset, shape.num_local_experts, self.tile)
        r = self.routing
        self.rows = r.total_num_padded_tokens
        self.local_rows = r.local_rows()
        assert (r.rows_from_mn_limit() == self.local_rows).all()
        self.device = dev = device
        i32 = torch.int32
        self.expanded = torch.from_numpy(r.expanded_idx_to_permuted_idx).to(dev, i32)
        self.total = torch.tensor([self.rows], dtype=i32, device=dev)
        # Sized as FlashInfer's workspace sizes them; the tiles the routing leaves unwritten hold
        # UNWRITTEN_MN_LIMIT, which only the total keeps the kernel from taking for rows.
        self.max_num_ctas = max_num_ctas_in_batch_dim(shape.num_tokens, TOP_K, NUM_EXPERTS, self.tile)
        num_tiles = len(r.cta_idx_xy_to_mn_limit)
        assert num_tiles <= self.max_num_ctas, (shape.label, num_tiles, self.max_num_ctas)
        pad = self.max_num_ctas - num_tiles + 1  # at least one element for an all-remote case
        self.mn_limit = torch.from_numpy(np.append(r.cta_idx_xy_to_mn_limit, [UNWRITTEN_MN_LIMIT] * pad)
                                         .astype(np.int32)).to(dev)
        self.batch_idx = torch.from_numpy(np.append(r.cta_idx_xy_to_batch_idx, [0] * pad).astype(np.int32)).to(dev)
        # Rows past the total exist in every buffer, filled, and must stay untouched.
        rows = self.rows + SLACK_TILES * self.tile
        inner = 2 * self.intermediate
        nb = self.intermediate // ref.NUM_ELTS_PER_SF
        # Values are drawn on the device (a 131,072-token TP8 case is 2 GB of float32).
        dgen = torch.Generator(device=dev).manual_seed(seed)
        values = torch.randn(rows, inner, generator=dgen, device=dev) * 3.0
        values[:, : inner // 2] *= torch.rand(rows, 1, generator=dgen, device=dev) * 4  # row-varying ranges
        if self.dtype == "e4m3":
            self.inp = values.to(torch.float8_e4m3fn).view(torch.uint8)
            self.out = torch.full((rows, self.intermediate), 0xA5, dtype=torch.uint8, device=dev)
        else:
            tdt = torch.bfloat16 if self.dtype == "bf16" else torch.float16
            self.inp = values.to(tdt).view(torch.int16)
            self.out = torch.full((rows, self.intermediate), 0x1A5, dtype=torch.int16, device=dev)
        del values
        self.in_sf = torch.exp2(torch.rand(2 * nb * rows, generator=dgen, device=dev) * 8 - 12)
        self.out_sf = torch.full((nb * rows,), -1234.5, dtype=torch.float32, device=dev)
        self.alpha = self.beta = self.limit = None
        e = shape.num_local_experts
        if shape.gated in ("full", "alpha"):
            self.alpha = (torch.rand(e, generator=gen) + 0.8).to(dev)
        if shape.gated in ("full", "beta"):
            self.beta = (torch.rand(e, generator=gen) - 0.5).to(dev)
        if shape.gated == "full":
            self.limit = (torch.rand(e, generator=gen) * 4 + 1).to(dev)
        if shape.gated not in (None, "full", "alpha", "beta"):
            raise ValueError(f"unknown gated variant {shape.gated!r}")
        self.fill_out, self.fill_sf = self.out.clone(), self.out_sf.clone()

    @staticmethod
    def _topk(torch, shape: Shape, gen):
        scores = torch.rand(shape.num_tokens, NUM_EXPERTS, generator=gen)
        if shape.routing == "skewed":
            # Zipf-like popularity (weight 1/rank^1.2, ranks shuffled over the experts),
            # sampled without replacement by Gumbel-top-k.
            rank = torch.randperm(NUM_EXPERTS, generator=gen).float() + 1
            gumbel = -torch.log(-torch.log(scores.clamp_min(1e-12)))
            scores = -1.2 * torch.log(rank) + gumbel
        elif shape.routing in ("local", "remote"):
            local = torch.zeros(NUM_EXPERTS, dtype=torch.bool)
            local[shape.local_offset: shape.local_offset + shape.num_local_experts] = True
            keep = local if shape.routing == "local" else ~local
            if int(keep.sum()) < TOP_K:
                raise ValueError(f"{shape.label}: fewer than top-k {shape.routing} experts")
            scores = torch.where(keep, scores, scores - 2.0)  # scores lie in [0, 1)
        elif shape.routing != "random":
            raise ValueError(f"unknown routing {shape.routing!r}")
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

    def gated_rows(self, rows):
        if self.alpha is None and self.beta is None and self.limit is None:
            return None
        expert = self.routing.cta_idx_xy_to_batch_idx[rows // self.tile]

        def pick(t):
            return None if t is None else t.cpu().numpy()[expert]

        return ref.GatedAct(pick(self.alpha), pick(self.beta), pick(self.limit))

    def reference_check(self, out, out_sf, max_rows: int, gen) -> dict:
        """The CPU reference on (a sample of) the local rows."""
        rows = self.local_rows
        if len(rows) > max_rows:
            pick = gen.choice(len(rows), size=max_rows - 2, replace=False)
            rows = np.unique(np.concatenate([rows[pick], rows[:1], rows[-1:]]))
        if len(rows) == 0:
            return {"ok": True, "elements": 0, "exact": 0, "one_step": 0}
        nb = self.intermediate // ref.NUM_ELTS_PER_SF
        idx = torch_.from_numpy(rows).to(self.device, torch_.long)
        inp = self.inp[idx].cpu().numpy().view(ref.DTYPES[self.dtype][0])
        in_sf = self.in_sf[: 2 * nb * self.rows].view(2 * nb, self.rows)[:, idx].T.cpu().numpy()
        q_ref, sf_ref = ref.activate_rows(inp, in_sf, self.dtype, self.gated_rows(rows))
        q_gpu = out[idx].cpu().numpy().view(ref.DTYPES[self.dtype][0])
        sf_gpu = out_sf[: nb * self.rows].view(nb, self.rows)[:, idx].T.cpu().numpy()
        return ref.compare_with_kernel(q_gpu, sf_gpu, q_ref, sf_ref, dtype=self.dtype)


# ---------------------------------------------------------------------------------------------
# The case grid


@dataclass(frozen=True)
class Check:
    """A bit-identity check: pristine against patched (both walks), one launch mode."""

    shape: Shape
    pdl: bool = False


@dataclass(frozen=True)
class Timing:
    """A timed serving shape: pristine and patched, the patched kernel in one walk."""

    kind: str  # decode, prefill, tp8, tile, slots, pdl
    shape: Shape
    walk: str = "rows"  # rows: the fused runner (MN limits set); slots: the staged API
    pdl: bool = False

    @property
    def label(self) -> str:
        extra = "".join(f"/{x}" for x, on in (("slots", self.walk == "slots"), ("pdl", self.pdl)) if on)
        return f"{self.kind}:{self.shape.label}{extra}"


ALL_TOKENS = (1, 2, 8, 16, 64, 256, 1024, 8192, 32768, 65536, 131072)
HUGE_TOKENS = (65536, 131072)  # bit-checked at the widths the presets run only
WIDTHS = (128, 256, 384, 1536, 2048)
TILES = (8, 16, 32, 64, 128)
TP8 = dict(num_local_experts=NUM_EXPERTS, width=256)  # the aggregated baseline: every expert local


def check_grid(full: bool = True) -> list[Check]:
    """Every case kind of the issue, each bit-checked (full=False: a few, for a smoke run)."""
    checks: list[Check] = []
    for n in ALL_TOKENS:
        for w in WIDTHS:
            if n in HUGE_TOKENS and w not in (256, 2048):
                continue
            checks.append(Check(Shape(n, width=w)))
    for n in (16, 1024, 32768):
        for tile in TILES:
            checks.append(Check(Shape(n, tile=tile)))
    for tile in TILES:
        checks.append(Check(Shape(1024, width=384, tile=tile)))
    for n in (1, 16, 1024, 32768):
        for w in (256, 2048):
            checks.append(Check(Shape(n, width=w), pdl=True))
    for n in (1, 16, 8192):
        for w in (384, 2048):
            checks.append(Check(Shape(n, width=w, routing="remote")))
            checks.append(Check(Shape(n, width=w, routing="local")))
    for n in (16, 8192):
        checks.append(Check(Shape(n, local_offset=96)))  # EP8 rank 3: experts 96..127
        checks.append(Check(Shape(n, width=384, local_offset=224, routing="local")))  # the last rank
    for n in (16, 2048):
        for w in (384, 2048):
            for g in ("full", "alpha", "beta"):
                checks.append(Check(Shape(n, width=w, gated=g)))
    for n in (16, 2048):
        for w in (256, 2048):
            for d in ("bf16", "fp16"):
                checks.append(Check(Shape(n, width=w, dtype=d)))
    checks.append(Check(Shape(2048, dtype="bf16", gated="full"), pdl=True))
    for n in (2048, 16384, 32768):
        checks.append(Check(Shape(n, routing="skewed")))
    for n in (1, 16, 1024, 8192, 32768, 131072):
        checks.append(Check(Shape(n, **TP8)))
    checks.append(Check(Shape(16, **TP8), pdl=True))
    if not full:
        keep = {Shape(16), Shape(1024, width=384), Shape(16, routing="remote"), Shape(16, gated="alpha"),
                Shape(16, **TP8), Shape(2048, width=256, dtype="bf16")}
        checks = [c for c in checks if c.shape in keep]
    return checks


def timing_grid(full: bool = True) -> list[Timing]:
    """The serving shapes: decode (<= 16 tokens, EP8, width 2048), TP8 (width 256), prefill to 131k."""
    timings = [Timing("decode", Shape(n)) for n in (1, 2, 8, 16, 64, 256)]
    timings += [Timing("decode", Shape(16), pdl=True)]
    timings += [Timing("tp8", Shape(n, **TP8)) for n in (1, 16, 256, 1024, 8192, 32768, 131072)]
    timings += [Timing("prefill", Shape(n)) for n in (1024, 2048, 8192, 16384, 32768, 65536, 131072)]
    timings += [Timing("prefill", Shape(32768, routing="skewed")), Timing("prefill", Shape(32768), pdl=True)]
    timings += [Timing("tile", Shape(32768, tile=64)), Timing("tile", Shape(1024, tile=64))]
    timings += [Timing("slots", Shape(n), walk="slots") for n in (16, 32768)]
    if not full:
        timings = [t for t in timings if t.shape.num_tokens <= 1024]
    return timings


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
    untouched = np.setdiff1d(np.arange(case.out.shape[0]), case.local_rows)
    if len(untouched):
        idx = torch_.from_numpy(untouched).to(case.device, torch_.long)
        same["untouched"] = bool(torch_.equal(got["rows"][0][idx], case.fill_out[idx]))
    if len(case.local_rows) == 0:  # all remote: nothing may be written anywhere
        same["nothing_written"] = bool(torch_.equal(got["rows"][0], case.fill_out)
                                       and torch_.equal(got["slots"][1], case.fill_sf))
    ok = all(same.values()) and refcheck["ok"]
    if not ok:
        failures.append(f"{label}: bit-identical {same}, reference {refcheck}")
    results.append({"case": label, "pdl": pdl, "local_rows": int(len(case.local_rows)), "padded_rows": case.rows,
                    "tile": case.tile, "bit_identical": same, "reference": refcheck})
    return same, refcheck


def nvcc_release(cuda: Path) -> str:
    """nvcc's own words: 'Cuda compilation tools, release 13.0, V13.0.88' and the build line."""
    proc = subprocess.run([str(cuda / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
    lines = [line.strip() for line in proc.stdout.splitlines() if line.startswith(("Cuda compilation", "Build"))]
    if proc.returncode != 0 or not lines:
        raise ab.BuildError(f"{cuda / 'bin' / 'nvcc'} --version: {proc.stdout}{proc.stderr}")
    return "; ".join(lines)


class Progress:
    """The results JSON, rewritten (atomically) after every case: a run stopped at its limit keeps
    what it did, and ``stage`` says where it stopped ("done" only once everything ran)."""

    def __init__(self, path: Path | None, header: dict):
        self.path = path
        self.result = {**header, "stage": "build", "timings": [], "checks": [], "failures": [], "goals": []}

    def save(self, stage: str | None = None) -> None:
        if stage:
            self.result["stage"] = stage
        if self.path is None:
            return
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.result, indent=2, default=str))
        partial.replace(self.path)


def run_checks(libs, checks: list[Check], seed_base: int, gen, ref_rows: int, results, failures,
               progress: Progress | None = None) -> None:
    log(f"bit-identity: {len(checks)} cases (pristine vs patched walking rows and slots; CPU reference on "
        f"up to {ref_rows} rows each)")
    for i, check in enumerate(checks):
        label = check.shape.label + ("/pdl" if check.pdl else "")
        case = Case(torch_, check.shape, seed=seed_base + i)
        same, refcheck = check_case(libs, case, results, failures, gen, ref_rows, label, pdl=check.pdl)
        status = "ok" if all(same.values()) and refcheck["ok"] else f"FAIL {same} {refcheck}"
        log(f"  {label:<40} rows {len(case.local_rows):>7}  tile {case.tile:>3}  {status}")
        del case
        if progress:
            progress.save()


def run_timings(libs, timings: list[Timing], iters: int, flush, copy_bw: float, seed_base: int,
                out: list[dict] | None = None, progress: Progress | None = None) -> list[dict]:
    log(f"{'shape':<44} {'rows':>7} {'pristine us':>12} {'patched us':>11} {'ratio':>7} {'GB/s':>6} {'%copy':>6}")
    out = [] if out is None else out
    for i, timing in enumerate(timings):
        case = Case(torch_, timing.shape, seed=seed_base + i)
        rows_walk = timing.walk == "rows"
        t_pri = time_us(lambda c=case: libs["pristine"].run(c, pdl=timing.pdl), iters, flush)
        t_pat = time_us(lambda c=case: libs["patched"].run(c, mn_limit=rows_walk, pdl=timing.pdl), iters, flush)
        bw = case.bytes_moved() / (t_pat * 1e-6)
        out.append({"label": timing.label, "kind": timing.kind, "tokens": timing.shape.num_tokens,
                    "width": timing.shape.width, "routing": timing.shape.routing, "tile": case.tile,
                    "walk": timing.walk, "pdl": timing.pdl, "local_rows": int(len(case.local_rows)),
                    "pristine_us": t_pri, "patched_us": t_pat, "ratio": t_pri / t_pat,
                    "patched_GBps": bw / 1e9, "copy_fraction": bw / copy_bw, "bytes": case.bytes_moved()})
        log(f"{timing.label:<44} {len(case.local_rows):>7} {t_pri:>12.1f} {t_pat:>11.1f} {t_pri / t_pat:>7.2f} "
            f"{bw / 1e9:>6.0f} {100 * bw / copy_bw:>5.0f}%")
        del case
        if progress:
            progress.save()
    return out


def goals_of(timings: list[dict]) -> list[tuple[str, bool, str]]:
    goals = []
    for t in timings:
        goals.append((f"patched not slower than pristine at {t['label']}", t["ratio"] >= 1.0, f"{t['ratio']:.2f}"))
        if t["kind"] == "prefill" and t["tokens"] == 32768 and not t["pdl"]:
            goals.append((f"ratio >= {GOAL_RATIO} at {t['label']} (the goal is B300's, from PR #3969)",
                          t["ratio"] >= GOAL_RATIO, f"{t['ratio']:.2f}"))
            goals.append((f"patched >= {GOAL_COPY_FRACTION:.0%} of copy bandwidth at {t['label']}",
                          t["copy_fraction"] >= GOAL_COPY_FRACTION, f"{t['copy_fraction']:.0%}"))
    return goals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", help="DIST_WORK directory (holds src/flashinfer)")
    p.add_argument("--bundle", help="a directory made by --make-bundle")
    p.add_argument("--make-bundle", metavar="DIR")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--arch", help="sm_90a, sm_100a, sm_103a (default: the GPU's)")
    p.add_argument("--out", default=None, help="build directory (default: a temporary one)")
    p.add_argument("--jobs", type=int, default=2, help="parallel nvcc builds")
    p.add_argument("--smoke", action="store_true", help="a few cases and shapes only")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--ref-rows", type=int, default=512, help="rows per case checked against the CPU reference")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="plot the timings here (plot.py)")
    p.add_argument("--no-perf-gate", action="store_true", help="report the goals but exit 0 if missed")
    args = p.parse_args(argv)

    import tempfile
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="dist-activation-"))
    out.mkdir(parents=True, exist_ok=True)
    revs = revisions(args, out)

    if args.make_bundle:
        make_bundle(revs, find_cuda(), Path(args.make_bundle), out)
        return 0
    if args.build_only:
        if not args.arch:
            sys.exit("run.py --build-only: pass --arch (sm_90a, sm_100a or sm_103a)")
        libs = build(revs, args.arch, find_cuda(), out, args.jobs)
        for name, lib in libs.items():
            log(f"{name}: {lib}")
        return 0

    global torch_, np
    import numpy as np
    import torch as torch_

    if not torch_.cuda.is_available():
        return unfit(args.json, f"no CUDA device: torch {torch_.__version__} (CUDA {torch_.version.cuda}) sees no GPU "
                                "(use --build-only to only build)")
    cuda = locate_cuda()
    if cuda is None:
        return unfit(args.json, NO_NVCC)
    arch = args.arch or detect_arch()
    props = torch_.cuda.get_device_properties(0)
    nvcc = nvcc_release(cuda)
    log(f"GPU: {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB, "
        f"arch {arch}; nvcc {cuda}: {nvcc}")
    if arch != "sm_103a":
        log(f"note: these numbers are for {props.name} ({arch}); the serving target is B300 (sm_103a), and a "
            "comparison with B300 figures is across devices")
    progress = Progress(Path(args.json) if args.json else None, {
        "gpu": props.name, "arch": arch, "sms": props.multi_processor_count, "nvcc": nvcc, "nvcc_path": str(cuda),
        "torch": torch_.__version__, "torch_cuda": torch_.version.cuda,
        "cross_device_note": None if arch == "sm_103a" else
        f"measured on {props.name} ({arch}); B300 (sm_103a) figures are another device"})
    progress.save()
    t_start = time.time()
    libs = {name: Library(path) for name, path in build(revs, arch, cuda, out, args.jobs).items()}
    if libs["pristine"].has_mn_limit or not libs["patched"].has_mn_limit:
        log("note: the 'patched' library does not take MN limits: is the patch applied to the tree?")
    if not libs["patched"].has_max_num_ctas:
        log("note: the 'patched' library does not take the MN-limit array's length: an older revision")
    gen = np.random.default_rng(0)
    flush = torch_.empty(max(2 * props.L2_cache_size, 64 << 20), dtype=torch_.uint8, device="cuda")
    copy_bw = copy_bandwidth(1 << 30)
    log(f"copy bandwidth (1 GiB device-to-device, read + write): {copy_bw / 1e9:.0f} GB/s")
    result = progress.result
    result.update(copy_GBps=copy_bw / 1e9, patched_takes_max_num_ctas=libs["patched"].has_max_num_ctas)
    results, failures = result["checks"], result["failures"]
    progress.save("checks")
    run_checks(libs, check_grid(not args.smoke), 1000, gen, args.ref_rows, results, failures, progress)
    log(f"checks done at {time.time() - t_start:.0f} s")
    progress.save("timings")
    timings = run_timings(libs, timing_grid(not args.smoke), args.iters, flush, copy_bw, 5000,
                          result["timings"], progress)

    goals = goals_of(timings)
    for name, met, value in goals:
        if not met or "B300" in name or "copy" in name:
            log(f"goal {'met   ' if met else 'MISSED'} {name}: {value}")
    log(f"{sum(met for _, met, _ in goals)} of {len(goals)} goals met; done in {time.time() - t_start:.0f} s")
    result["goals"] = goals
    result["verdict"] = ("wrong results" if failures else
                         "slower than pristine or a goal missed" if not all(met for _, met, _ in goals) else "passed")
    progress.save("done")
    if args.png:
        try:
            import plot
            plot.plot(result, Path(args.png))
            log(f"wrote {args.png}")
        except ImportError as exc:  # no matplotlib on the GPU machine: plot the JSON elsewhere
            log(f"no PNG ({exc}); run plot.py on the JSON")
    if failures:
        log(f"WRONG RESULTS ({len(failures)} of {len(results)} cases):\n  " + "\n  ".join(failures))
        return 1
    log(f"bit-identical and within the CPU reference's bounds: {len(results)} of {len(results)} cases")
    if not args.no_perf_gate and not all(met for _, met, _ in goals):
        return 3
    return 0


torch_ = None
np = None

if __name__ == "__main__":
    sys.exit(main())
