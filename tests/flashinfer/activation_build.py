"""Building FlashInfer's fused-MoE activation kernels outside FlashInfer's JIT.

Shared by the CPU compile check (test_activation_compile.py) and the GPU harness
(gpu/run.py). Needs only the Python standard library.

The trees: the patched FlashInfer tree is ``$DIST_WORK/src/flashinfer`` (default
``<repo>/work``), a git checkout whose HEAD carries the patch series; the pristine
sources are the commit ``refs/dist/pristine`` of that repository. ``DIST_FLASHINFER_TREE``
names another such checkout instead (``make forward`` points it at a newer release's). For the pristine
build, the files the series changes are written out at their pristine revision into
an overlay directory whose include roots come first (see ``Sources``).

Flags: the nvcc flags are read from the tree's own JIT code (``flashinfer/jit``),
from the very lists FlashInfer passes to nvcc for the ``fused_moe_trtllm_sm100``
module, so a change upstream shows up here (``jit_nvcc_flags``). Include roots
follow FlashInfer's order (``cpp_ext.build_common_cflags``), mapped from the wheel
layout (``data/include``, ``data/cutlass``...) to the sdist's (``include``,
``3rdparty/cutlass``...).

Stand-ins (``harness/include``): ``DevKernel.h`` includes two trtllm-gen export headers,
``DtypeDecl.h`` and ``SfLayoutDecl.h`` (which pull in more of the set: four in all),
that FlashInfer downloads at JIT time; the file uses only two enums from them.
``harness/include`` declares just those enumerators. cuBLAS headers
(included, unused, by ``flashinfer/trtllm/common/cudaUtils.h``) get empty stand-ins
searched after the toolkit's own, so a full toolkit's headers win where present.
"""
from __future__ import annotations

import ast
import io
import os
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

try:  # a package in the repository, a plain folder in a GPU bundle
    from . import nvcc_cache
except ImportError:
    import nvcc_cache  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STAND_INS = HERE / "harness" / "include"
CUBLAS_STAND_INS = HERE / "harness" / "include-cublas"

DEV_KERNEL = "csrc/fused_moe/trtllm_backend/trtllm_fused_moe_dev_kernel.cu"
PRISTINE_REF = "refs/dist/pristine"
ACTIVATION_END = "}  // namespace activation"

# FlashInfer's include roots for this module, in its order, as sdist paths:
# fused_moe.gen_trtllm_gen_fused_moe_sm100_module's extra_include_paths (-I; gen_root is
# harness/include here), cpp_ext.get_cccl_includes (-I), then cpp_ext.get_system_includes
# (-isystem; the Python and tvm-ffi roots are left out: nothing in this module's device
# code includes them).
USER_ROOTS = ["csrc/nv_internal", "csrc/nv_internal/include"]
CCCL_ROOTS = ["3rdparty/cccl/cub", "3rdparty/cccl/libcudacxx/include", "3rdparty/cccl/thrust"]
SYSTEM_ROOTS = [
    "include",
    "csrc",
    "3rdparty/cutlass/include",
    "3rdparty/cutlass/tools/util/include",
    "3rdparty/spdlog/include",
]
ARCHS = {"sm_103a": "103a", "sm_100a": "100a", "sm_90a": "90a"}


class BuildError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# Locations


def work_dir() -> Path:
    return Path(os.environ.get("DIST_WORK") or REPO / "work")


TREE_ENV = "DIST_FLASHINFER_TREE"


def flashinfer_tree() -> Path:
    """$DIST_FLASHINFER_TREE when set (another release's prepared tree), else $DIST_WORK/src/flashinfer."""
    chosen = os.environ.get(TREE_ENV)
    return Path(chosen) if chosen else work_dir() / "src" / "flashinfer"


def missing_tree_hint() -> str:
    """How to get a tree where flashinfer_tree() looks."""
    if os.environ.get(TREE_ENV):
        return f"{TREE_ENV} names it; `make forward` prepares one"
    return "set DIST_WORK, or run `make patched`"


def cuda_home(extra_env: tuple[str, ...] = ()) -> Path | None:
    """DIST_CUDA_HOME (then any of extra_env), if it holds bin/nvcc."""
    for name in ("DIST_CUDA_HOME", *extra_env):
        value = os.environ.get(name)
        if value and (Path(value) / "bin" / "nvcc").is_file():
            return Path(value)
    return None


def _git(tree: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"git -C {tree} {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def pristine_text(tree: Path, rel: str) -> str:
    return _git(tree, "show", f"{PRISTINE_REF}:{rel}")


def activation_part(text: str) -> str:
    """The file from its first line through the end of ``namespace activation``.

    The namespaces after it (convertsf, permute, finalize) are declared later in the
    file, so nothing in the activation code can depend on them; the prefix compiles
    the activation kernels exactly as the whole file does, in a fraction of the time.
    """
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip() == ACTIVATION_END:
            return "".join(lines[: i + 1]) + "\n}  // namespace moe::dev\n"
    raise BuildError(f"{DEV_KERNEL}: no line {ACTIVATION_END!r}; update activation_part()")


# The harness's SM90 variant of the patched kernel. FlashInfer builds this module for SM100/SM103
# only, and the shipped kernel asks for 8 CTAs per SM (64 registers), which is free of spills
# there; on SM90 the E4m3 instantiation spills at 64 registers, so the H100/H200 harness builds it
# for 6 CTAs per SM. Only this line differs; the timing of an SM90 run is of this variant.
SM90_MIN_CTAS = ("constexpr int DEEP_SEEK_ACTIVATION_MIN_CTAS_PER_SM = 8;",
                 "constexpr int DEEP_SEEK_ACTIVATION_MIN_CTAS_PER_SM = 6;")


def harness_variant(text: str, arch: str) -> str:
    """The source the harness compiles for arch: the revision's own, except SM90's occupancy line."""
    if arch != "sm_90a" or SM90_MIN_CTAS[0] not in text:
        return text  # the pristine revision has no such line
    return text.replace(SM90_MIN_CTAS[0], SM90_MIN_CTAS[1], 1)


HEADER_SUFFIXES = (".h", ".cuh", ".hpp", ".hh", ".inl", ".inc")


@dataclass
class Sources:
    """One FlashInfer revision to build: a tree, plus an overlay that shadows part of it.

    ``overlay`` holds whole include roots (tree-relative paths) at this revision, for the
    roots in which a header differs from the checkout in ``tree``; they are searched
    first. Whole roots, so that a header's relative includes resolve at the same revision.
    """

    name: str
    tree: Path
    overlay: Path | None = None
    overlay_roots: tuple[str, ...] = ()

    def path(self, rel: str) -> Path:
        if self.overlay is not None and (self.overlay / rel).is_file():
            return self.overlay / rel
        return self.tree / rel

    def text(self, rel: str) -> str:
        return self.path(rel).read_text()

    def roots(self, rels: list[str]) -> list[Path]:
        out: list[Path] = []
        for rel in rels:
            if self.overlay is not None and rel in self.overlay_roots:
                out.append(self.overlay / rel)
            out.append(self.tree / rel)
        return out


def patched_sources(tree: Path | None = None) -> Sources:
    tree = tree or flashinfer_tree()
    if not (tree / DEV_KERNEL).is_file():
        raise BuildError(f"no FlashInfer tree at {tree} ({missing_tree_hint()})")
    return Sources("patched", tree)


def pristine_sources(tree: Path, overlay_dir: Path) -> Sources:
    """The pristine revision of ``tree``: ``refs/dist/pristine`` of its repository.

    The source files the harness compiles are read with ``git show``; each include root
    holding a header that HEAD changes is extracted whole, at the pristine revision,
    into overlay_dir (for this series: ``include``, 6 MB).
    """
    changed = [p for p in _git(tree, "diff", "--name-only", PRISTINE_REF, "HEAD", "--").splitlines() if p]
    if overlay_dir.exists():
        shutil.rmtree(overlay_dir)
    overlay_dir.mkdir(parents=True)
    roots = sorted({root for rel in changed if rel.endswith(HEADER_SUFFIXES)
                    for root in USER_ROOTS + CCCL_ROOTS + SYSTEM_ROOTS if rel.startswith(root + "/")})
    if roots:
        archive = subprocess.run(["git", "-C", str(tree), "archive", "--format=tar", PRISTINE_REF, "--", *roots],
                                 capture_output=True)
        if archive.returncode != 0:
            raise BuildError(f"git archive {PRISTINE_REF} {roots}: {archive.stderr.decode().strip()}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(overlay_dir, filter="data")
    sources = Sources("pristine", tree, overlay_dir, tuple(roots))
    dest = overlay_dir / DEV_KERNEL
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(pristine_text(tree, DEV_KERNEL))
    return sources


# ---------------------------------------------------------------------------------------------
# Flags, read from the tree's JIT code


# Lists spliced into the module's flags that the harness leaves out: the Rubin variant's define,
# the arch flags (JitFlags.for_arch adds them per arch) and FlashInfer 0.7.4's aarch64-only host
# flags (empty on an x86-64 host).
LEFT_OUT = ("rubin_flags", "nvcc_flags", "_manifest_host_compile_flags()")


def _strings(node: ast.AST, placeholders: dict[str, str] | None = None) -> list[str] | None:
    """String elements of a list literal; None if it holds anything else (a variable...).

    Starred elements are handled by ``placeholders`` (call name -> value) or dropped
    when they name a list the harness leaves out on purpose (LEFT_OUT).
    """
    if not isinstance(node, ast.List):
        return None
    out: list[str] = []
    for elt in node.elts:
        if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
            out.append(elt.value)
        elif isinstance(elt, ast.JoinedStr):
            # f-string: only -DTLLM_GEN_GEMM_CUBIN_PATH, a host-side path; render a placeholder.
            # The JIT writes it for a shell (ninja), quotes escaped; no shell runs nvcc here.
            value = "".join(v.value if isinstance(v, ast.Constant) else "unavailable" for v in elt.values)
            out.append(value.replace('\\"', '"'))
        elif isinstance(elt, ast.Starred):
            name = ast.unparse(elt.value)
            if placeholders and name in placeholders:
                out.append(placeholders[name])
            elif name not in LEFT_OUT:
                return None
        else:
            return None
    return out


def _assigned(fn: ast.FunctionDef, name: str) -> ast.AST | None:
    """The value last assigned to ``name`` in ``fn``'s body."""
    found = None
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [name]:
            found = node.value
    return found


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise BuildError(f"no function {name}() in FlashInfer's JIT code; update jit_nvcc_flags()")


@dataclass
class JitFlags:
    common: list[str] = field(default_factory=list)  # gen_jit_spec's cuda_cflags
    build: list[str] = field(default_factory=list)  # cpp_ext.build_cuda_cflags' own
    module: list[str] = field(default_factory=list)  # the fused_moe_trtllm module's
    arch_common: list[str] = field(default_factory=list)  # CompilationContext.COMMON_NVCC_FLAGS

    def for_arch(self, arch: str, nvcc_version: tuple[int, int] | None = None) -> list[str]:
        code = ARCHS.get(arch, arch.removeprefix("sm_"))
        gencode = f"-gencode=arch=compute_{code},code=sm_{code}"
        flags = [*self.build, *self.arch_common, *self.common, *self.module, gencode, *self.arch_common]
        if nvcc_version is not None and nvcc_version < (12, 8):
            # FlashInfer adds these only from CUDA 12.8 on (cpp_ext.build_cuda_cflags); older nvcc
            # rejects them. The pinned toolchain is 13.0; this is for a GPU machine's own nvcc.
            flags = [f for f in flags if f not in NVCC_12_8_FLAGS]
        return flags


def jit_nvcc_flags(tree: Path) -> JitFlags:
    """nvcc flags of FlashInfer's fused_moe_trtllm_sm100 module (non-debug build).

    From flashinfer/jit/core.py (gen_jit_spec), jit/cpp_ext.py (build_cuda_cflags),
    compilation_context.py (COMMON_NVCC_FLAGS) and jit/fused_moe.py
    (gen_trtllm_gen_fused_moe_sm100_module; from 0.7.4 the list it passes is built by
    trtllm_gen_fused_moe_build_inputs). Raises BuildError if their shape changed.
    """
    jit = tree / "flashinfer" / "jit"
    flags = JitFlags()

    fn = _function(ast.parse((jit / "core.py").read_text()), "gen_jit_spec")
    std = None
    fast_math = False
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "cuda_cflags":
            flags.common = _strings(node.value, {"get_nvcc_parallelism_flags()": "--threads=1"}) or []
        if (isinstance(node, ast.Call) and ast.unparse(node.func) == "cuda_cflags.insert"
                and isinstance(node.args[1], ast.Constant)):
            if node.args[1].value == "-use_fast_math":
                # 0.7.4 and later: inserted after the parallelism flags unless use_fast_math=False,
                # which the fused-MoE module does not pass (checked below)
                fast_math = True
            else:
                std = node.args[1].value
        if isinstance(node, ast.If) and ast.unparse(node.test) == "debug":
            for stmt in node.orelse:
                if isinstance(stmt, ast.AugAssign) and ast.unparse(stmt.target) == "cuda_cflags":
                    flags.common += _strings(stmt.value) or []
    if fast_math and "-use_fast_math" not in flags.common:
        flags.common.insert(flags.common.index("--threads=1") + 1, "-use_fast_math")
    if std:
        flags.common.insert(0, std)

    fn = _function(ast.parse((jit / "cpp_ext.py").read_text()), "build_cuda_cflags")
    for node in ast.walk(fn):
        if isinstance(node, ast.AugAssign) and ast.unparse(node.target) == "cuda_cflags":
            values = _strings(node.value)
            if values:  # lists with variables (-ccbin $CC) are environment-specific
                flags.build += [v for v in values if v != "$common_cflags"]

    ctx = ast.parse((tree / "flashinfer" / "compilation_context.py").read_text())
    for node in ast.walk(ctx):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "COMMON_NVCC_FLAGS":
            flags.arch_common = _strings(node.value) or []

    fused_moe = ast.parse((jit / "fused_moe.py").read_text())
    fn = _function(fused_moe, "gen_trtllm_gen_fused_moe_sm100_module")
    for node in ast.walk(fn):
        if isinstance(node, ast.keyword) and node.arg == "use_fast_math":
            raise BuildError("the fused-MoE module now sets use_fast_math; update jit_nvcc_flags()")
        if isinstance(node, ast.keyword) and node.arg == "extra_cuda_cflags":
            value = node.value.left if isinstance(node.value, ast.BinOp) else node.value
            if isinstance(value, ast.Name):
                # 0.7.4 and later: the list is built by trtllm_gen_fused_moe_build_inputs
                value = _assigned(_function(fused_moe, "trtllm_gen_fused_moe_build_inputs"), value.id)
            flags.module = _strings(value) or []

    missing = [name for name, got in (("gen_jit_spec cuda_cflags", flags.common),
                                      ("build_cuda_cflags", flags.build),
                                      ("COMMON_NVCC_FLAGS", flags.arch_common),
                                      ("module extra_cuda_cflags", flags.module)) if not got]
    if missing or "-use_fast_math" not in flags.common or "-O3" not in flags.common:
        raise BuildError(f"could not read FlashInfer's nvcc flags ({', '.join(missing) or 'fast-math/-O3'}); "
                         "update jit_nvcc_flags()")
    return flags


NVCC_12_8_FLAGS = ("-static-global-template-stub=false", "--compress-mode=size")


def nvcc_version(cuda: Path) -> tuple[int, int]:
    out = subprocess.run([str(cuda / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise BuildError(f"cannot read the version of {cuda / 'bin' / 'nvcc'}: {out.strip()}")
    return int(m.group(1)), int(m.group(2))


def include_flags(sources: Sources, cuda: Path) -> list[str]:
    flags = [f"-I{STAND_INS}"]
    flags += [f"-I{p}" for p in sources.roots(USER_ROOTS)]
    flags += [f"-I{p}" for p in sources.roots(CCCL_ROOTS)]
    flags += ["-isystem", str(cuda / "include")]
    for p in sources.roots(SYSTEM_ROOTS):
        flags += ["-isystem", str(p)]
    flags += ["-isystem", str(CUBLAS_STAND_INS)]
    return flags


def nvcc(cuda: Path, args: list[str], log: Path, timeout: int = 600) -> str:
    """Run nvcc; return its output; raise BuildError with the output on failure.

    With ``DIST_NVCC_CACHE`` set, a compile whose inputs are byte for byte those of a
    kept one takes its outputs instead of running (nvcc_cache); the log says so.
    """
    cmd = [str(cuda / "bin" / "nvcc"), *args]
    env = dict(os.environ, PATH=f"{cuda / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    store, outputs = nvcc_cache.cache_dir(), nvcc_cache.outputs_of(args)
    key = nvcc_cache.compile_key(cuda / "bin" / "nvcc", args, env) if store and outputs else None
    if key is not None and (out := nvcc_cache.lookup(store, key, outputs)) is not None:
        log.write_text(" ".join(cmd) + "\n\n" + out)
        return out
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    out = proc.stdout + proc.stderr
    log.write_text(" ".join(cmd) + "\n\n" + out)
    if proc.returncode != 0:
        raise BuildError(f"nvcc failed ({proc.returncode}), log {log}:\n{out[-4000:]}")
    if key is not None:
        nvcc_cache.keep(store, key, outputs, out)
    return out


# ---------------------------------------------------------------------------------------------
# ptxas -v and PTX


def short_name(mangled: str) -> str:
    """``activationDeepSeekKernel<float_e4m3_t,1,pdl>`` from the mangled name."""
    m = re.search(r"10activation(\d+)", mangled)
    if not m:
        return mangled
    start = m.end()
    name = mangled[start: start + int(m.group(1))]
    t = re.search(r"7cutlass(\d+)", mangled)
    dtype = mangled[t.end(): t.end() + int(t.group(1))] if t else "?"
    n = re.search(r"ELi(\d+)E", mangled)
    pdl = re.search(r"ELb([01])E", mangled)
    return f"{name}<{dtype},{n.group(1) if n else '?'},{'pdl' if pdl and pdl.group(1) == '1' else 'nopdl'}>"


def ptxas_stats(log: str) -> dict[str, dict]:
    """Per entry function: registers, barriers, smem, stack frame and spill bytes."""
    stats: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '([^']+)'", line)
        if m:
            current = stats.setdefault(m.group(1), {"arch": m.group(2)})
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = stats.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
            b = re.search(r"used (\d+) barriers", line)
            current["barriers"] = int(b.group(1)) if b else 0
            s = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(s.group(1)) if s else 0
    return stats


def ptx_functions(ptx: str) -> dict[str, str]:
    """Entry name -> PTX body."""
    matches = list(re.finditer(r"^\.visible \.entry (\S+)\(", ptx, re.M))
    return {m.group(1): ptx[m.start(): matches[i + 1].start() if i + 1 < len(matches) else len(ptx)]
            for i, m in enumerate(matches)}


def normalized_ptx(body: str) -> str:
    """PTX of one function with names that depend on its neighbours made canonical.

    Drops comments, blank lines, register declarations and the parameter block size, and renames
    virtual registers and labels in order of appearance, so that two compilations of
    the same function in different translation units compare equal.
    """
    body = re.sub(r"^\s*//.*$", "", body, flags=re.M)
    body = re.sub(r"^\s*\.reg .*$", "", body, flags=re.M)
    body = re.sub(r"_param_0\[\d+\]", "_param_0[N]", body)
    names: dict[str, str] = {}
    counts: dict[str, int] = {}

    def rename(m: re.Match) -> str:
        token = m.group(0)
        if token not in names:
            kind = m.group(1)
            names[token] = f"{kind}#{counts.get(kind, 0)}"
            counts[kind] = counts.get(kind, 0) + 1
        return names[token]

    body = re.sub(r"(%rs|%rd|%r|%fd|%f|%p|\$L__BB)[\d_]+", rename, body)
    return "\n".join(line.rstrip() for line in body.splitlines() if line.strip())


FLOAT_OPS = re.compile(r"^\s*(?:@!?%p\w+\s+)?((?:[a-z0-9]+)(?:\.[a-z0-9]+)*\.(?:f32|f16x2|f16|bf16x2|bf16))\b", re.M)
CVT_OPS = re.compile(r"\b(cvt(?:\.[a-z0-9]+)+)\b")


def float_ops(body: str) -> set[str]:
    """The floating-point instructions of a PTX function, packing (x2) folded away.

    These are what decide the bits of a result: their kind (approximate or IEEE division,
    FTZ, fused or separate multiply-add) and rounding mode. A packed conversion rounds
    each half as the scalar one does, hence the folding.
    """
    ops = set(FLOAT_OPS.findall(body)) | {c for c in CVT_OPS.findall(body) if not re.search(r"\.[su](8|16|32|64)\b", c)}
    return {re.sub(r"(f16|bf16|e4m3|e5m2|f32)x2", r"\1", op) for op in ops
            if not op.startswith(("ld.", "st.", "mov.", "shfl."))}
