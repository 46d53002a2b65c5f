"""The image's Python closure in a few layers, and their bytecode written deterministically.

One pip layer of ~9 GB pulls serially and is re-pulled whole on any lock bump,
so the runtime installs the lock in groups, one layer each, biggest and
stablest first: the NVIDIA libraries, torch, the rest, then vLLM with our
own LMCache and FlashInfer wheels (what a patch or a vLLM bump changes).

``split`` writes one --require-hashes requirements file per group from
build/lock/image.txt (every lock entry lands in exactly one group).
``compile`` writes the .pyc of the given distributions' RECORD files as
unchecked-hash bytecode: pip --no-compile leaves none, and pip's own
timestamped .pyc embed the install time, so two builds differ; hash-based
.pyc depend only on the source (PYTHONHASHSEED=0 fixes set ordering).

    python3 layers.py split /opt/glm53/lock/image.txt /tmp/layers
    python3 -m imagectl.layers compile --requirements /tmp/layers/nvidia.txt
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import py_compile
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

GROUPS = ("nvidia", "torch", "rest", "vllm")
TORCH = {"torch", "torchaudio", "torchvision", "torchcodec", "triton"}
# vLLM and the kernels only vLLM pulls in: what a vLLM bump changes, next to our wheels.
VLLM = {"vllm", "humming-kernels", "quack-kernels", "tilelang", "tokenspeed-mla", "tokenspeed-triton", "xgrammar",
        "flashinfer-cubin", "flashinfer-jit-cache"}
NVIDIA_PREFIXES = ("nvidia-", "cuda-", "cupy-cuda")
NVIDIA = {"cufile-python", "nvtx", "nccl4py", "nccl-extensions", "pynvvideocodec"}
_REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def group_of(name: str) -> str:
    n = normalize(name)
    if n in TORCH:
        return "torch"
    if n in VLLM:
        return "vllm"
    if n in NVIDIA or n.startswith(NVIDIA_PREFIXES):
        return "nvidia"
    return "rest"


def split(lock_text: str) -> dict[str, str]:
    """{group: requirements text}; a requirement's continuation lines (hashes) stay with it."""
    out: dict[str, list[str]] = {g: [] for g in GROUPS}
    current: str | None = None
    for line in lock_text.splitlines():
        m = _REQ.match(line)
        if m:
            current = group_of(m.group(1))
            out[current].append(line)
        elif line.startswith((" ", "\t")) and current is not None:
            out[current].append(line)
        else:
            current = None
    return {g: "\n".join(lines) + "\n" for g, lines in out.items()}


def names(requirements: str) -> list[str]:
    return [m.group(1) for m in map(_REQ.match, requirements.splitlines()) if m]


def _compile(path: str) -> bool:
    try:
        py_compile.compile(path, doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
        return True
    except (py_compile.PyCompileError, SyntaxError, UnicodeDecodeError, OSError):
        return False   # pip's compileall skips these too (templates, py2-only vendored files)


def sources_of(dist_names: list[str]) -> list[str]:
    out: list[str] = []
    for name in dist_names:
        dist = importlib.metadata.distribution(name)
        for f in dist.files or ():
            if f.suffix == ".py":
                out.append(str(f.locate()))
    return sorted(set(out))


def compile_dists(dist_names: list[str], jobs: int) -> tuple[int, int]:
    if os.environ.get("PYTHONHASHSEED") != "0":
        raise SystemExit("imagectl.layers compile: run with PYTHONHASHSEED=0 (bytecode of sets depends on it)")
    files = sources_of(dist_names)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        done = list(pool.map(_compile, files, chunksize=64))
    return sum(done), len(done) - sum(done)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="imagectl.layers", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("lock", type=Path)
    s.add_argument("out", type=Path)
    s = sub.add_parser("compile")
    s.add_argument("--requirements", type=Path, action="append", default=[])
    s.add_argument("dists", nargs="*")
    s.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)
    if args.cmd == "split":
        groups = split(args.lock.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        for group, text in groups.items():
            (args.out / f"{group}.txt").write_text(text)
            print(f"imagectl.layers: {group}: {len(names(text))} distribution(s)")
        if not all(names(t) for t in groups.values()):
            print("imagectl.layers: a layer group is empty (the lock changed shape?)", file=sys.stderr)
            return 1
        return 0
    dists = list(args.dists)
    for req in args.requirements:
        dists += names(req.read_text())
    ok, skipped = compile_dists(dists, args.jobs)
    print(f"imagectl.layers: {ok} .pyc (unchecked-hash) for {len(dists)} distribution(s), "
          f"{skipped} source(s) not compilable")
    return 0


if __name__ == "__main__":
    sys.exit(main())
