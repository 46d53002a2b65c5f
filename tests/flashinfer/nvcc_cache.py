"""Outputs of nvcc compiles kept by the content of everything the compile reads.

``make test`` compiles the activation kernels twelve times (the compile check's six
translation units, the GPU harness's three pairs of libraries) and spends most of
phase 1's single-core time there, on inputs that change only when the kernel, the
harness or the toolchain does. This keeps each compile's outputs under a key of:

* the toolchain: every file of nvcc's home (its drivers, ``cicc``, ``ptxas``,
  libdevice, headers and libraries), the host compiler's and the linker's
  ``--version`` and every header of the host compiler's search folders (nvcc runs it
  for every compile, device-only ones included, to preprocess);
* every argument, where a file stands for its bytes and a directory (an include or
  library root) for the bytes and names of every file below it, so the key does not
  depend on where a tree or a temp folder lies;
* the headers beside each source file (quoted includes are looked up there first);
* ``NVCC_PREPEND_FLAGS`` and ``NVCC_APPEND_FLAGS``, which nvcc reads from the
  environment.

The key covers more than the compile reads (a whole include root for a few of its
headers), never less: a change anywhere in a root is a new compile. Only compiles
that write an output file (``-o``) and succeeded are kept; ``-M`` and other
preprocessor-only runs name paths in their output and always run.

``DIST_NVCC_CACHE`` names the folder; unset or empty, every compile runs (the
default outside ``make test``, and on a GPU machine). ``make test`` sets it beside
its download cache; ``DIST_NVCC_CACHE= make test`` compiles everything afresh.
Standard library only: the GPU harness imports this from a bundle.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CACHE_ENV = "DIST_NVCC_CACHE"
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".cuh", ".inl", ".inc", ".ipp", ".tcc")
ENV_FLAGS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")
OUTPUT_FLAGS = ("-o", "--output-file")
KEEP_DIR_FLAGS = ("--keep-dir", "-keep-dir")
PREPROCESS_ONLY = ("-M", "-MM", "--generate-dependencies", "-E", "--preprocess", "--dryrun", "-dryrun")
PATH_PREFIXES = ("-I", "-L", "-isystem", "-include")
RESULT = "result.json"
REUSED = "# reused: the outputs of an identical compile"
# make test keeps about 0.3 GB per state of the kernel and harness (the keep folders hold the
# preprocessed sources); past this, the entries used longest ago go
MAX_BYTES = 4 << 30


def cache_dir() -> Path | None:
    chosen = os.environ.get(CACHE_ENV, "")
    return Path(chosen) if chosen else None


@dataclass(frozen=True)
class Outputs:
    """Where one compile writes: its output file and, with ``--keep``, its keep folder."""

    file: Path
    keep_dir: Path | None


def outputs_of(args: list[str]) -> Outputs | None:
    """The compile's outputs, or None when it is not one this cache keeps."""
    if any(a in PREPROCESS_ONLY for a in args):
        return None
    file = keep = None
    for i, arg in enumerate(args):
        if arg in OUTPUT_FLAGS and i + 1 < len(args):
            file = Path(args[i + 1])
        for flag in KEEP_DIR_FLAGS:
            if arg.startswith(flag + "="):
                keep = Path(arg.split("=", 1)[1])
            elif arg == flag and i + 1 < len(args):
                keep = Path(args[i + 1])
    return Outputs(file, keep) if file is not None else None


@lru_cache(maxsize=None)
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digest(path: Path) -> str:
    stat = path.stat()
    return _file_digest(path.resolve(), stat.st_size, stat.st_mtime_ns)


def tree_digest(root: Path) -> str:
    """Names and bytes of every file below ``root`` (symlinks followed, as the compiler does)."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath, name)
            if path.is_file():
                digest.update(f"{path.relative_to(root)}\0{file_digest(path)}\0".encode())
    return digest.hexdigest()


def _path_token(value: str) -> str | None:
    path = Path(value.strip('"'))
    if not value or not path.is_absolute() and not path.exists():
        return None
    if path.is_dir():
        return f"dir:{tree_digest(path)}"
    if path.is_file():
        return f"file:{file_digest(path)}"
    return None


def _search_root_token(value: str) -> str:
    # a root that does not exist holds nothing the compile can read (a bundle carries only
    # the roots its build reads from), wherever it would have been
    return _path_token(value) or "absent"


def _arg_token(arg: str, previous: str) -> str:
    if previous in PATH_PREFIXES:
        return _search_root_token(arg)
    token = _path_token(arg)
    if token is not None:
        return token
    for prefix in PATH_PREFIXES:
        if arg.startswith(prefix) and len(arg) > len(prefix):
            return prefix + _search_root_token(arg[len(prefix):])
    if arg.startswith("-D") and "=" in arg:
        name, value = arg.split("=", 1)
        token = _path_token(value)
        if token is not None:
            return f"{name}={token}"
    return arg


def _argument_tokens(args: list[str]) -> list[str]:
    tokens, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg in OUTPUT_FLAGS or arg in KEEP_DIR_FLAGS:
            tokens.append(f"{arg} <output>")
            skip = True
        elif arg.startswith(tuple(f + "=" for f in KEEP_DIR_FLAGS)):
            tokens.append("--keep-dir=<output>")
        else:
            tokens.append(_arg_token(arg, args[i - 1] if i else ""))
    return tokens


def _neighbour_headers(args: list[str]) -> list[str]:
    """Headers in the folder of each source file: quoted includes look there first."""
    tokens = []
    for arg in args:
        if arg.endswith((".cu", ".cpp", ".cc")) and Path(arg).is_file():
            folder = Path(arg).resolve().parent
            tokens += [f"{p.name}:{file_digest(p)}" for p in sorted(folder.iterdir())
                       if p.suffix in HEADER_SUFFIXES and p.is_file()]
    return tokens


@lru_cache(maxsize=None)
def _version(command: tuple[str, ...]) -> str:
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=60)
    except OSError as exc:
        return f"unavailable: {exc}"
    return done.stdout + done.stderr


@lru_cache(maxsize=None)
def _host_headers(compiler: str) -> tuple[str, ...]:
    """Digests of the host compiler's header search folders (``-v`` lists them)."""
    try:
        done = subprocess.run([compiler, "-E", "-x", "c++", "-v", "-"], input="", capture_output=True,
                              text=True, timeout=60)
    except OSError as exc:
        return (f"unavailable: {exc}",)
    listed = done.stderr.split("search starts here:")[-1].split("End of search list.")[0]
    folders = sorted({Path(line.strip()).resolve() for line in listed.splitlines()
                      if line.startswith(" ") and Path(line.strip()).is_dir()})
    outermost = [f for f in folders if not any(o != f and o in f.parents for o in folders)]
    return tuple(f"{f.name}:{tree_digest(f)}" for f in outermost)


def _host_compiler(args: list[str], env: dict[str, str]) -> str:
    for flag in ("-ccbin", "--compiler-bindir"):
        if flag in args:
            return args[args.index(flag) + 1]
    return shutil.which("g++", path=env.get("PATH")) or "g++"


def compile_key(nvcc: Path, args: list[str], env: dict[str, str]) -> str:
    host = _host_compiler(args, env)
    parts = {
        "nvcc": tree_digest(nvcc.resolve().parents[1]),
        "host": [_version((host, "--version")), _version(("ld", "--version")), *_host_headers(host)],
        "args": _argument_tokens(args),
        "beside": _neighbour_headers(args),
        "env": {name: env.get(name, "") for name in ENV_FLAGS},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def lookup(root: Path, key: str, outputs: Outputs) -> str | None:
    """Copy a kept compile's outputs into place; its compiler output, or None on a miss."""
    entry = root / key[:2] / key
    try:
        result = json.loads((entry / RESULT).read_text())
        shutil.copyfile(entry / "output", outputs.file)
        if outputs.keep_dir is not None:
            shutil.copytree(entry / "keep", outputs.keep_dir, dirs_exist_ok=True)
    except (OSError, ValueError):
        return None
    os.utime(entry)  # what was used last is kept longest
    return f"{REUSED} ({CACHE_ENV} {root}, key {key[:16]}, " \
           f"compiled {result['compiled']})\n" + result["log"]


def keep(root: Path, key: str, outputs: Outputs, log: str) -> None:
    """Store a compile's outputs; a concurrent compile of the same key may have stored them first."""
    entry = root / key[:2] / key
    if entry.exists() or not outputs.file.is_file():
        return
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=entry.parent))
    try:
        shutil.copyfile(outputs.file, staging / "output")
        if outputs.keep_dir is not None and outputs.keep_dir.is_dir():
            shutil.copytree(outputs.keep_dir, staging / "keep")
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (staging / RESULT).write_text(json.dumps({"compiled": stamp, "log": log}))
        staging.rename(entry)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    prune(root)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def prune(root: Path, max_bytes: int = MAX_BYTES) -> None:
    """Remove the entries used longest ago until the store holds at most ``max_bytes``."""
    entries = sorted((e for e in root.glob("??/*") if not e.name.startswith(".")), key=lambda e: e.stat().st_mtime)
    sizes = {e: _size(e) for e in entries}
    total = sum(sizes.values())
    for entry in entries:
        if total <= max_bytes:
            break
        shutil.rmtree(entry, ignore_errors=True)
        total -= sizes[entry]
