"""FlashInfer's trtllm-gen artifacts (headers, kernel lists, cubins) as pinned inputs.

FlashInfer pins, in ``flashinfer/artifacts.py``, the store folder of each
artifact (``ArtifactPath``) and the sha256 of that folder's manifest,
``checksums.txt`` (``CheckSumHash``); the manifest lists a sha256 per file.
This module fetches the artifacts the serving path needs (``NEEDED``) from a
mirror (FlashInfer's store by default, an HTTP mirror or a local folder a site
keeps) into the download cache, along that chain: the manifest is checked
against the pin read from the **patched** FlashInfer tree, every file against
the manifest. Files are written through a ``.partial`` name and renamed only
once verified; a warm cache never touches the network.

The cache folder has FlashInfer's own layout (``FLASHINFER_CUBIN_DIR /
<ArtifactPath> / <file>``), so the image copies it as is and points
``FLASHINFER_CUBIN_DIR`` at it. ``RECORD`` (written last) lists what a complete
set holds; ``make image`` stages a set only when its record is there, and
``make image RELEASE=1`` refuses to build without a complete set for the patched
tree's pins (``release_problems``).

Why these artifacts (vLLM 0.31.0 on SM103 serving GLM-5.3 FP8, kv-cache fp8):
- ``TRTLLM_GEN_BMM``: the FP8 block-scale fused MoE, vLLM's FLASHINFER_TRTLLM
  backend (``fused_moe/oracle/fp8.py``) calling ``trtllm_fp8_block_scale_moe``,
  FlashInfer module ``fused_moe_trtllm_sm100`` (``jit/fused_moe.py``: manifest,
  ``include/flashinferMetaInfo.h``, the ``trtllmGen_bmm_export`` headers at
  compile time, the batched-GEMM cubins at first use).
- ``TRTLLM_GEN_FMHA``: sparse MLA attention; with an fp8 KV cache vLLM ranks
  FLASHINFER_MLA_SPARSE first on SM10x (``platforms/cuda.py``,
  ``_get_backend_priorities``), which calls ``trtllm_batch_decode_with_kv_cache_mla``,
  FlashInfer module ``fmha_gen`` (``jit/attention/modules.py``:
  ``include/flashInferMetaInfo.h`` at compile time, the FMHA cubins at first use).
  Its dense-MHA prefill for GLM's MLA dims (192/64/256) is TRTLLM_RAGGED
  (``mla/prefill/selector.py``), ``trtllm_ragged_attention_deepseek``: the same module.
The dense FP8 linears need none: FlashInfer's block-scale GEMM is SM90-only in
vLLM 0.31.0 (``has_flashinfer_fp8_blockscale_gemm``), so SM103 runs DeepGEMM.
"""
from __future__ import annotations

import ast
import hashlib
import http.client
import json
import os
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable

from .errors import DistBuildError
from .fetch import CHUNK, sha256_of
from .progress import ProgressBar

# Artifact (ArtifactPath attribute) -> the FlashInfer modules that need it.
NEEDED: dict[str, tuple[str, ...]] = {
    "TRTLLM_GEN_BMM": ("fused_moe_trtllm_sm100",),
    "TRTLLM_GEN_FMHA": ("fmha_gen",),
}
CACHE_SUBDIR = "flashinfer-cubins"
MANIFEST = "checksums.txt"
RECORD = "flashinfer-artifacts.json"
TIMEOUT_S = 60.0
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Artifact:
    key: str               # ArtifactPath attribute name, e.g. TRTLLM_GEN_BMM
    path: str              # store folder, relative, ending in "/"
    manifest_sha256: str   # CheckSumHash: sha256 of <path>checksums.txt

    @property
    def manifest_path(self) -> str:
        return self.path + MANIFEST


@dataclass(frozen=True)
class Pins:
    store: str                       # FlashInfer's default FLASHINFER_CUBINS_REPOSITORY
    artifacts: tuple[Artifact, ...]  # the NEEDED ones, in NEEDED order


def _class_strings(module: ast.Module, name: str, where: Path) -> dict[str, str]:
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            out = {}
            for stmt in node.body:
                target = stmt.target if isinstance(stmt, ast.AnnAssign) else (
                    stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None)
                value = getattr(stmt, "value", None)
                if isinstance(target, ast.Name) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    out[target.id] = value.value
            return out
    raise DistBuildError(f"{where}: no class {name} (is this FlashInfer's artifacts.py?)")


def _default_store(cubin_loader: Path) -> str:
    """The default of ``os.environ.get("FLASHINFER_CUBINS_REPOSITORY", <default>)``."""
    module = ast.parse(cubin_loader.read_text(), str(cubin_loader))
    for node in ast.walk(module):
        if (isinstance(node, ast.Call) and len(node.args) == 2
                and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)
                and node.args[0].value == "FLASHINFER_CUBINS_REPOSITORY"):
            return node.args[1].value
    raise DistBuildError(f"{cubin_loader}: no FLASHINFER_CUBINS_REPOSITORY default found")


def read_pins(tree: Path, needed: Iterable[str] = NEEDED) -> Pins:
    """The artifact pins of a FlashInfer source tree (parsed, not imported: the tree needs torch)."""
    artifacts_py = tree / "flashinfer" / "artifacts.py"
    cubin_loader = tree / "flashinfer" / "jit" / "cubin_loader.py"
    for path in (artifacts_py, cubin_loader):
        if not path.is_file():
            raise DistBuildError(f"{path}: missing; the patched FlashInfer tree comes from `make patched`")
    module = ast.parse(artifacts_py.read_text(), str(artifacts_py))
    paths = _class_strings(module, "ArtifactPath", artifacts_py)
    hashes = _class_strings(module, "CheckSumHash", artifacts_py)
    out = []
    for key in needed:
        if key not in paths or key not in hashes:
            raise DistBuildError(f"{artifacts_py}: {key} has no ArtifactPath and CheckSumHash pair")
        if not _SHA256.match(hashes[key]):
            raise DistBuildError(f"{artifacts_py}: CheckSumHash.{key} = {hashes[key]!r} is not a sha256")
        path = paths[key].strip("/") + "/"
        _check_relative(path, f"{artifacts_py}: ArtifactPath.{key}")
        out.append(Artifact(key, path, hashes[key]))
    return Pins(_default_store(cubin_loader), tuple(out))


def _check_relative(name: str, where: str) -> None:
    parts = PurePosixPath(name).parts
    if not name or name.startswith("/") or "\\" in name or ".." in parts or "." in parts:
        raise DistBuildError(f"{where}: {name!r} is not a plain relative path")


def parse_manifest(data: bytes, where: str) -> dict[str, str]:
    """``checksums.txt``: ``<sha256> <relative path>`` per line -> {path: sha256}."""
    entries: dict[str, str] = {}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DistBuildError(f"{where}: not UTF-8 text") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2 or not _SHA256.match(fields[0]):
            raise DistBuildError(f"{where}:{number}: expected '<sha256> <file>', got {line[:120]!r}")
        _check_relative(fields[1], f"{where}:{number}")
        entries[fields[1]] = fields[0]
    if not entries:
        raise DistBuildError(f"{where}: lists no files")
    return entries


class Mirror:
    """FlashInfer's store layout served over HTTP(S) or from a local folder (``file:`` or a path)."""

    def __init__(self, location: str) -> None:
        self.location = location
        if location.startswith(("http://", "https://")):
            self.base: str | Path = location if location.endswith("/") else location + "/"
        else:
            folder = Path(urllib.request.url2pathname(urllib.parse.urlsplit(location).path)
                          if location.startswith("file:") else location)
            if not folder.is_dir():
                raise DistBuildError(f"FlashInfer artifact mirror {location}: no such folder")
            self.base = folder

    def url(self, name: str) -> str:
        if isinstance(self.base, Path):
            return str(self.base / name)
        return urllib.parse.urljoin(self.base, urllib.parse.quote(name))

    def open(self, name: str):
        try:
            if isinstance(self.base, Path):
                return (self.base / name).open("rb")
            return urllib.request.urlopen(self.url(name), timeout=TIMEOUT_S)
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise DistBuildError(f"FlashInfer artifact mirror {self.location}: cannot fetch {name}: {reason}") from None


@dataclass
class FetchResult:
    root: Path
    fetched: int = 0
    cached: int = 0
    bytes_fetched: int = 0
    files: int = 0


def _cached_ok(path: Path, sha256: str) -> bool:
    if not path.is_file():
        return False
    if sha256_of(path) == sha256:
        return True
    path.unlink()      # a corrupt cache entry is refetched, never used
    return False


def _fetch_verified(mirror: Mirror, name: str, dest: Path, sha256: str, bar: ProgressBar, pinned_by: str) -> int:
    """Stream ``name`` to ``dest`` through ``.partial``; rename only when its sha256 is ``sha256``."""
    partial = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    digest = hashlib.sha256()
    written = 0
    source = mirror.open(name)      # an unreachable mirror fails here, before anything is created
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with source, partial.open("wb") as out:
            try:
                for block in iter(lambda: source.read(CHUNK), b""):
                    out.write(block)
                    digest.update(block)
                    written += len(block)
                    bar.update(len(block))
            except (OSError, http.client.HTTPException) as exc:
                raise DistBuildError(f"FlashInfer artifact mirror {mirror.location}: {name}: download broke off "
                                     f"after {written} bytes: {exc}") from None
        got = digest.hexdigest()
        if got != sha256:
            raise DistBuildError(f"FlashInfer artifact {name} from {mirror.url(name)}: sha256 mismatch: "
                                 f"expected {sha256} ({pinned_by}), got {got}; refused, nothing written")
        partial.replace(dest)
    finally:
        partial.unlink(missing_ok=True)
    return written


def _manifest(mirror: Mirror, artifact: Artifact, root: Path, result: FetchResult,
              log: Callable[[str], None]) -> dict[str, str]:
    local = root / artifact.manifest_path
    if _cached_ok(local, artifact.manifest_sha256):
        result.cached += 1
    else:
        bar = ProgressBar(f"fetch    {artifact.manifest_path}", None)
        _fetch_verified(mirror, artifact.manifest_path, local, artifact.manifest_sha256, bar,
                        f"CheckSumHash.{artifact.key} in flashinfer/artifacts.py")
        bar.close()
        result.fetched += 1
        log(f"verified {artifact.manifest_path} (sha256 {artifact.manifest_sha256[:12]}, CheckSumHash.{artifact.key})")
    return parse_manifest(local.read_bytes(), str(local))


def fetch_set(pins: Pins, mirror: Mirror, root: Path, log: Callable[[str], None] = print) -> FetchResult:
    """Fetch every file of every pinned artifact into ``root`` (FLASHINFER_CUBIN_DIR layout), verified.

    ``pins`` is the root of trust: ``read_pins`` of the patched tree in the
    build; a test passes its own. The record is removed first and written last,
    so a set is complete exactly when its record exists.
    """
    result = FetchResult(root)
    (root / RECORD).unlink(missing_ok=True)
    record = {"store": pins.store, "mirror": mirror.location, "artifacts": []}
    for artifact in pins.artifacts:
        entries = _manifest(mirror, artifact, root, result, log)
        todo = [(name, sha) for name, sha in sorted(entries.items())
                if not _cached_ok(root / artifact.path / name, sha)]
        result.cached += len(entries) - len(todo)
        result.files += len(entries) + 1
        if todo:
            log(f"fetch    {artifact.key}: {len(todo)} of {len(entries)} file(s) from {mirror.location}")
            bar = ProgressBar(f"fetch    {artifact.key}", None)
            for done, (name, sha) in enumerate(todo, 1):
                result.bytes_fetched += _fetch_verified(mirror, artifact.path + name, root / artifact.path / name,
                                                        sha, bar, f"{artifact.manifest_path}")
                result.fetched += 1
                if not bar.tty and done * 10 // len(todo) != (done - 1) * 10 // len(todo):
                    log(f"fetch    {artifact.key}: {done}/{len(todo)} file(s)")
            bar.close()
        record["artifacts"].append({"key": artifact.key, "path": artifact.path,
                                    "manifest_sha256": artifact.manifest_sha256,
                                    "files": len(entries), "modules": list(NEEDED.get(artifact.key, ()))})
    _write_atomic(root / RECORD, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return result


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}.partial-{os.getpid()}"
    try:
        partial.write_text(text)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


@dataclass
class SetStatus:
    root: Path
    complete: bool
    missing: list[str]        # relative paths absent (or, with a deep check, not matching)
    record: dict | None


def set_status(root: Path, deep: bool = False) -> SetStatus:
    """What a cached set holds, by its record and manifests (``deep``: every file re-hashed)."""
    record_path = root / RECORD
    if not record_path.is_file():
        return SetStatus(root, False, [f"{RECORD} (no complete set: run `make flashinfer-artifacts`)"], None)
    record = json.loads(record_path.read_text())
    missing: list[str] = []
    for entry in record.get("artifacts", []):
        manifest = root / entry["path"] / MANIFEST
        if not manifest.is_file() or sha256_of(manifest) != entry["manifest_sha256"]:
            missing.append(entry["path"] + MANIFEST)
            continue
        for name, sha in parse_manifest(manifest.read_bytes(), str(manifest)).items():
            path = root / entry["path"] / name
            if not path.is_file() or (deep and sha256_of(path) != sha):
                missing.append(entry["path"] + name)
    return SetStatus(root, not missing, missing, record)


def stage(cache_root: Path, context_dir: Path, log: Callable[[str], None] = print) -> SetStatus:
    """Put a complete cached set into the image's build context (hard links where possible).

    ``context_dir`` is emptied first except its README, so a stale set never
    reaches a build; an incomplete set stages nothing. The ``flashinfer-wheel``
    stage verifies the staged files again against the tree it compiles.
    """
    context_dir.mkdir(parents=True, exist_ok=True)
    for child in context_dir.iterdir():
        if child.name == "README.md":
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    status = set_status(cache_root)
    if not status.complete:
        return status
    assert status.record is not None
    names = [RECORD] + [entry["path"] + MANIFEST for entry in status.record["artifacts"]]
    for entry in status.record["artifacts"]:
        manifest = cache_root / entry["path"] / MANIFEST
        names += [entry["path"] + name for name in parse_manifest(manifest.read_bytes(), str(manifest))]
    for name in names:
        dest = context_dir / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(cache_root / name, dest)
        except OSError:
            shutil.copy2(cache_root / name, dest)
    log(f"staged   FlashInfer artifact set: {len(names)} file(s) from {cache_root} into {context_dir}")
    return status


def release_problems(status: SetStatus, pins: Pins | None = None) -> list[str]:
    """Why a cached or staged set cannot make a release image (``[]``: it can).

    An incomplete set names what is missing (with ``pins``, the pinned manifests
    an absent set lacks); a complete set fetched for other pins than ``pins``
    (the patched tree the image compiles) names each artifact that differs.
    """
    if status.record is None and pins is not None:
        return [f"{a.manifest_path} (CheckSumHash.{a.key} {a.manifest_sha256[:12]}) and every file it lists"
                for a in pins.artifacts]
    if not status.complete:
        return list(status.missing)
    if pins is None:
        return []
    assert status.record is not None
    held = {e["key"]: (e["path"], e["manifest_sha256"]) for e in status.record.get("artifacts", [])}
    problems = []
    for artifact in pins.artifacts:
        got = held.get(artifact.key)
        if got != (artifact.path, artifact.manifest_sha256):
            have = f"{got[0]}{MANIFEST} sha256 {got[1][:12]}" if got else "nothing"
            problems.append(f"{artifact.key}: the set holds {have}, the patched tree pins "
                            f"{artifact.manifest_path} sha256 {artifact.manifest_sha256[:12]}")
    return problems


def default_mirror(pins: Pins) -> str:
    """FlashInfer's own override variable if the site set it, else the store the tree names."""
    return os.environ.get("FLASHINFER_CUBINS_REPOSITORY") or pins.store


__all__ = ["Artifact", "Mirror", "NEEDED", "Pins", "RECORD", "default_mirror", "fetch_set", "parse_manifest",
           "read_pins", "release_problems", "set_status", "stage"]
