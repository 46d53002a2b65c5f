"""Ahead-of-time FlashInfer modules for sm_103a and the artifact set they need (build stage).

``python -m imagectl.flashinfer_aot --tree SRC --cubins-in DIR --out OUT --status FILE``
with the patched FlashInfer installed, ``FLASHINFER_CUDA_ARCH_LIST=10.3a`` and
``distbuild`` importable (the build stages carry it).

The modules vLLM 0.31.0 loads to serve GLM-5.3 FP8 on SM103 (``MODULES``;
the reasons are in ``distbuild/flashinfer_artifacts.py``) are compiled only
from a complete artifact set: ``make flashinfer-artifacts`` fetches it into the
download cache, ``make image`` stages it into the build context and this step
verifies it again, against the pins of the tree it compiles (``--tree``: the
patched sources), while copying it to ``OUT/cubins``. Then, with
``FLASHINFER_CUBIN_DIR`` pointing there and ``FLASHINFER_NO_DOWNLOAD`` set
(FlashInfer may not fetch anything behind our back), each module is built and
copied to ``OUT/aot/<module>/<module>.so``, where ``flashinfer.jit.env.get_aot_path``
finds it. The runtime stage carries ``OUT/cubins`` as ``FLASHINFER_CUBIN_DIR``.

Without a complete set nothing is compiled; the status file says ``missing``,
what is missing and what that costs on the GPU node (``DEVELOPMENT``: the image
then needs FlashInfer's artifact store at first use), and the stage succeeds
(``make image RELEASE=1`` then fails). A corrupt staged file or a failed compile
is an error (exit 1).

``check_cubin_dir`` is the run-time check (preflight, self-test): stdlib only.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

MODULE = "fused_moe_trtllm_sm100"          # the status file's headline module (labels, self-test)
IMAGE_CUBIN_DIR = "/opt/flashinfer/cubins"  # where the runtime stage puts OUT/cubins
RECORD = "flashinfer-artifacts.json"        # distbuild.flashinfer_artifacts.RECORD
MANIFEST = "checksums.txt"
# What an image built without the set is (its io.glm53.image.kind label, the self-test, the preflight).
DEVELOPMENT = "development image: needs FlashInfer's artifact store at first use"


@dataclass(frozen=True)
class Module:
    name: str             # FlashInfer's module name (its AOT path)
    gen: str              # "package.module:function" returning the JitSpec
    artifacts: tuple[str, ...]
    used_for: str


MODULES = (
    Module(MODULE, "flashinfer.jit.fused_moe:gen_trtllm_gen_fused_moe_sm100_module", ("TRTLLM_GEN_BMM",),
           "FP8 block-scale fused MoE (vLLM moe backend FLASHINFER_TRTLLM)"),
    Module("fmha_gen", "flashinfer.jit:gen_trtllm_gen_fmha_module", ("TRTLLM_GEN_FMHA",),
           "sparse MLA attention (vLLM FLASHINFER_MLA_SPARSE, the SM10x choice with an fp8 KV cache)"),
    Module("sampling", "flashinfer.jit.sampling:gen_sampling_module", (),
           "top-k/top-p sampling (VLLM_USE_FLASHINFER_SAMPLER, on by default)"),
    Module("trtllm_comm", "flashinfer.jit.comm:gen_trtllm_comm_module", (),
           "all-reduce + RMSNorm fusion (vLLM fuse_allreduce_rms, TP > 1: the aggregated preset)"),
)


def consequence(store: str, missing_artifacts: list[str]) -> str:
    names = ", ".join(m.name for m in MODULES)
    return (f"{DEVELOPMENT}: nothing is compiled ahead of time: on the GPU node FlashInfer JIT-compiles "
            f"{names} at first use (minutes each with the image's nvcc, per container start unless /cache "
            f"persists) and downloads {', '.join(missing_artifacts)} (headers and every cubin a kernel needs) "
            f"from {store}; a node without access to that store fails at the first fused-MoE or sparse-MLA call "
            f"(with the presets' pinned backends: at start). Fix: `make flashinfer-artifacts "
            f"[FLASHINFER_MIRROR=url-or-folder]`, then `make image RELEASE=1`.")


def write_status(path: Path, status: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(status, indent=1, sort_keys=True) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest_entries(path: Path) -> dict[str, str]:
    entries = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) == 2:
            entries[fields[1]] = fields[0]
    return entries


def pinned_artifacts(status: dict) -> dict[str, str]:
    """Artifact folder -> manifest sha256 that the image's FlashInfer pins (its status file's
    ``artifacts``, written from the compiled tree's ``flashinfer/artifacts.py``)."""
    return {entry["path"]: entry["manifest_sha256"] for entry in (status.get("artifacts") or {}).values()
            if isinstance(entry, dict) and "path" in entry and "manifest_sha256" in entry}


def set_summary(cubin_dir: str | os.PathLike[str]) -> str:
    """``2 artifact(s) (TRTLLM_GEN_BMM, TRTLLM_GEN_FMHA), 1234 file(s)`` from a complete set's record."""
    record = json.loads((Path(cubin_dir) / RECORD).read_text())
    artifacts = record.get("artifacts", [])
    files = sum(int(a.get("files", 0)) for a in artifacts)
    return f"{len(artifacts)} artifact(s) ({', '.join(a.get('key', '?') for a in artifacts)}), {files} file(s)"


def check_cubin_dir(cubin_dir: str | os.PathLike[str] | None = None, deep: bool = False,
                    pinned: dict[str, str] | None = None) -> list[str]:
    """Problems with the artifact set FlashInfer will read (``[]``: complete, nothing to download).

    ``cubin_dir`` defaults to ``$FLASHINFER_CUBIN_DIR``; unset or empty means
    the image carries no set. Checks the set's record, each manifest against
    the sha256 the build verified it with, and that every listed file is there
    (``deep``: re-hashed too; that reads every cubin, so not for a start-up check).
    ``pinned`` (``pinned_artifacts`` of the image's status file): the set must hold
    each of these manifests, so a mounted set fetched for another FlashInfer is refused.
    """
    chosen = os.fspath(cubin_dir) if cubin_dir is not None else os.environ.get("FLASHINFER_CUBIN_DIR", "")
    if not chosen:
        return ["FLASHINFER_CUBIN_DIR is not set: this image carries no FlashInfer artifact set "
                "(it was built without one; FlashInfer downloads them from its store at first use)"]
    root = Path(chosen)
    record_path = root / RECORD
    if not record_path.is_file():
        return [f"{record_path}: missing (FLASHINFER_CUBIN_DIR={root} holds no complete artifact set)"]
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as exc:
        return [f"{record_path}: unreadable: {exc}"]
    problems: list[str] = []
    for entry in record.get("artifacts", []):
        manifest = root / entry["path"] / MANIFEST
        if not manifest.is_file():
            problems.append(f"{manifest}: missing")
            continue
        got = _sha256(manifest)
        if got != entry["manifest_sha256"]:
            problems.append(f"{manifest}: sha256 {got}, the build verified {entry['manifest_sha256']}")
            continue
        for name, sha in _manifest_entries(manifest).items():
            path = root / entry["path"] / name
            if not path.is_file():
                problems.append(f"{path}: missing")
            elif deep and _sha256(path) != sha:
                problems.append(f"{path}: sha256 does not match {manifest}")
    if not record.get("artifacts"):
        problems.append(f"{record_path}: lists no artifacts")
    held = {entry.get("path"): entry.get("manifest_sha256") for entry in record.get("artifacts", [])}
    for path, sha in (pinned or {}).items():
        if held.get(path) != sha:
            problems.append(f"{record_path}: holds no {path}{MANIFEST} with sha256 {sha[:12]}, which this image's "
                            "FlashInfer pins (a set fetched for another FlashInfer)")
    return problems


def _staged_problem(fa, pins, cubins_in: Path) -> tuple[str | None, list[str]]:
    """Why the staged set cannot be used (None: it can), and what is missing."""
    needed = [a.manifest_path for a in pins.artifacts]
    status = fa.set_status(cubins_in)
    if status.record is None:
        return (f"no FlashInfer artifact set in the build context ({cubins_in} is empty: "
                "`make flashinfer-artifacts` was not run, or its set is incomplete)",
                [f"{p} (pinned) and every file it lists" for p in needed])
    staged = {e["path"]: e["manifest_sha256"] for e in status.record.get("artifacts", [])}
    wanted = {a.path: a.manifest_sha256 for a in pins.artifacts}
    if any(staged.get(path) != sha for path, sha in wanted.items()):
        return (f"the staged artifact set was fetched for other pins ({staged}) than this tree's "
                f"flashinfer/artifacts.py ({wanted}); rerun `make flashinfer-artifacts`", needed)
    if not status.complete:
        return f"the staged artifact set is incomplete ({len(status.missing)} file(s))", status.missing
    return None, []


def _gen(module: Module):
    package, function = module.gen.split(":")
    return getattr(importlib.import_module(package), function)


def build(tree: Path, cubins_in: Path, out: Path, status_file: Path) -> int:
    from distbuild import flashinfer_artifacts as fa
    from distbuild.errors import DistBuildError

    arch_list = os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "")
    pins = fa.read_pins(tree)
    cubins = out / "cubins"
    cubins.mkdir(parents=True, exist_ok=True)      # the runtime stage copies it either way
    (out / "aot").mkdir(parents=True, exist_ok=True)
    status: dict = {"module": MODULE, "cuda_arch_list": arch_list, "artifact_store": pins.store,
                    "artifacts": {a.key: {"path": a.path, "manifest_sha256": a.manifest_sha256}
                                  for a in pins.artifacts},
                    "modules": {m.name: {"used_for": m.used_for, "artifacts": list(m.artifacts)} for m in MODULES}}
    reason, missing = _staged_problem(fa, pins, cubins_in)
    if reason is not None:
        status.update(status="missing", missing=missing, reason=reason, cubin_dir="",
                      consequence=consequence(pins.store, [a.key for a in pins.artifacts]))
        write_status(status_file, status)
        print(f"flashinfer-aot: NOT BUILT ({', '.join(m.name for m in MODULES)} for {arch_list}): {reason}",
              file=sys.stderr)
        for name in missing[:20]:
            print(f"flashinfer-aot: missing {name}", file=sys.stderr)
        if len(missing) > 20:
            print(f"flashinfer-aot: ... and {len(missing) - 20} more", file=sys.stderr)
        print(f"flashinfer-aot: on the GPU node: {status['consequence']}", file=sys.stderr)
        return 0
    try:   # verified again along the chain of the tree compiled here, while copied to OUT/cubins
        fetched = fa.fetch_set(pins, fa.Mirror(str(cubins_in)), cubins,
                               log=lambda line: print(f"flashinfer-aot: {line}"))
    except DistBuildError as exc:
        print(f"flashinfer-aot: the staged artifact set is corrupt: {exc}", file=sys.stderr)
        return 1
    os.environ["FLASHINFER_CUBIN_DIR"] = str(cubins)
    os.environ["FLASHINFER_NO_DOWNLOAD"] = "1"
    for module in MODULES:
        spec = _gen(module)()
        print(f"flashinfer-aot: compiling {module.name} for {arch_list}", flush=True)
        spec.build(verbose=True)
        dest = out / "aot" / module.name / f"{module.name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.get_library_path(), dest)
        status["modules"][module.name].update(so=f"{module.name}/{module.name}.so", sha256=_sha256(dest))
    headline = status["modules"][MODULE]
    status.update(status="built", so=headline["so"], sha256=headline["sha256"], missing=[], cubin_dir=IMAGE_CUBIN_DIR,
                  artifact_files=fetched.files)
    write_status(status_file, status)
    print(f"flashinfer-aot: built {len(MODULES)} module(s) for {arch_list}; {fetched.files} artifact file(s) "
          f"for FLASHINFER_CUBIN_DIR={IMAGE_CUBIN_DIR}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="imagectl.flashinfer_aot", description=__doc__)
    p.add_argument("--tree", type=Path, required=True, help="the patched FlashInfer sources the wheel was built from")
    p.add_argument("--cubins-in", type=Path, required=True, help="the staged artifact set (may be empty)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--status", type=Path, required=True)
    args = p.parse_args(argv)
    return build(args.tree, args.cubins_in, args.out, args.status)


if __name__ == "__main__":
    sys.exit(main())
