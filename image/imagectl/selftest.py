"""Self-test of the serving image, without a GPU: ``IMAGE self-test [--json] [--strict]``.

Checks, one line each (PASS / WARN / FAIL), exit 1 on any FAIL (``--strict``:
on any WARN too):

- the Python and the pinned packages (vLLM, torch with CUDA 13, nixl-cu13,
  LMCache, FlashInfer) have the versions the manifest's pins name;
- the installed LMCache and FlashInfer are the patched trees: every installed
  file that the tree has matches its git blob id, and every file the series
  changes is installed with its patched content (not the pristine one);
- LMCache's CUDA extension is installed;
- FlashInfer resolves its fused-MoE module to the ahead-of-time build for
  sm_103a; when the build recorded that it could not make it, WARN with why;
- what the image is: a release carries FlashInfer's artifact set complete in
  ``FLASHINFER_CUBIN_DIR`` with ``VLLM_HAS_FLASHINFER_CUBIN=1``; a development
  image WARNs that it needs FlashInfer's artifact store at first use;
- ``ldd`` of the NIXL plugins finds every library (the image's libfabric 2.1.0 for
  LIBFABRIC), ``fi_info -l`` lists the efa provider, and NIXL instantiates both
  backends the presets select (LIBFABRIC and UCX);
- vLLM sees FlashInfer: its own ``has_flashinfer()`` and
  ``has_flashinfer_trtllm_fused_moe()`` are True (else the presets' pinned MoE
  backend fails at start), and FlashInfer's ``get_cuda_path()`` resolves a
  CUDA 13.0 ``nvcc`` (FAIL otherwise);
- no path is claimed by two installed distributions with different content,
  and every hashed RECORD entry matches the file on disk;
- manifest, SBOM, presets, the P/D proxy and the tools are in place; the
  cache folders are writable.

``--stage sources`` checks a ``sources`` build stage instead: the trees in
/work/src are the ones the manifest names.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .presets import ROLES
from .treemap import blob_id

HOME = Path(os.environ.get("GLM53_HOME", "/opt/glm53"))
CONFIG_ROOT = Path(os.environ.get("GLM53_CONFIGS", "/etc/glm53"))
AOT_MODULE = "fused_moe_trtllm_sm100"
# Files a wheel build rewrites, so they cannot equal the tree: setuptools_scm's
# version file (it carries the +glm53.<tree> version) and FlashInfer's build
# metadata. They are reported, not compared.
GENERATED = {"lmcache": frozenset({"lmcache/_version.py"}), "flashinfer": frozenset({"flashinfer/_build_meta.py"})}


@dataclass
class Check:
    name: str
    status: str   # PASS, WARN, FAIL
    detail: str


def _pin_versions(manifest: dict) -> dict[str, str]:
    """Project name -> pinned version, from the manifest's inputs (pins.toml)."""
    out = {}
    for entry in manifest.get("inputs", []):
        if entry.get("role") in ("image", "upstream"):
            out[re.sub(r"[-_.]+", "-", entry["name"]).lower()] = entry["version"]
    return out


def check_version(name: str, installed: str | None, pinned: str | None, local: str | None = None) -> Check:
    if pinned is None:
        return Check(f"version {name}", "FAIL", "the manifest pins no version for it")
    if installed is None:
        return Check(f"version {name}", "FAIL", f"not installed (pinned {pinned})")
    public, _, local_part = installed.partition("+")
    if public != pinned:
        return Check(f"version {name}", "FAIL", f"{installed} installed, {pinned} pinned")
    if local is not None and local_part != local:
        return Check(f"version {name}", "FAIL", f"{installed}: local part should be {local!r} (the patched tree)")
    return Check(f"version {name}", "PASS", installed)


def _installed_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def installed_path(site: Path, tree_path: str, data_prefixes: tuple[str, ...]) -> Path | None:
    for prefix in ("", *data_prefixes):
        candidate = site / prefix / tree_path
        if candidate.is_file():
            return candidate
    return None


def compare_tree(name: str, treemap: dict, site: Path, package: str, data_prefixes: tuple[str, ...] = (),
                 generated: frozenset[str] = frozenset()) -> Check:
    """Installed files vs the patched tree's blob ids; the series' files must be patched."""
    files: dict[str, str] = treemap["files"]
    checked = differ = 0
    wrong: list[str] = []
    for tree_path, oid in files.items():
        if tree_path in generated:
            continue
        if not (tree_path.startswith(package + "/") or any(tree_path.startswith(p) for p in ("csrc/", "include/"))):
            continue
        found = installed_path(site, tree_path, data_prefixes)
        if found is None:
            continue
        checked += 1
        if blob_id(found.read_bytes()) != oid:
            differ += 1
            wrong.append(tree_path)
    series_files = [(p, c) for p, c in treemap["changed"].items() if c["patched"]]
    patched_ok, pristine_seen, not_shipped = [], [], []
    for tree_path, change in series_files:
        found = installed_path(site, tree_path, data_prefixes)
        if found is None:
            not_shipped.append(tree_path)
            continue
        oid = blob_id(found.read_bytes())
        if oid == change["patched"]:
            patched_ok.append(tree_path)
        elif oid == change["pristine"]:
            pristine_seen.append(tree_path)
    tree = treemap["patched_tree"][:12]
    if pristine_seen:
        return Check(f"patched {name}", "FAIL", f"PRISTINE content installed for {', '.join(pristine_seen)}")
    if differ:
        return Check(f"patched {name}", "FAIL",
                     f"{differ} of {checked} files differ from tree {tree}: {', '.join(wrong[:3])}")
    if not patched_ok and series_files:
        return Check(f"patched {name}", "FAIL",
                     f"none of the {len(series_files)} files the series changes is installed")
    regenerated = f", {len(generated)} regenerated by the build" if generated else ""
    return Check(f"patched {name}", "PASS",
                 f"tree {tree}: {checked} files match, {len(patched_ok)} patched by the series "
                 f"({len(not_shipped)} series files are tests/sources not shipped{regenerated})")


def flashinfer_aot_path(module: str) -> Path:
    """Where FlashInfer itself resolves an AOT module (its own resolver, as at run time)."""
    from flashinfer.jit import env as jit_env
    return Path(jit_env.get_aot_path(module))


def check_aot(aot: dict, site: Path, resolve=flashinfer_aot_path) -> Check:
    expected = site / "flashinfer" / "data" / "aot" / AOT_MODULE / f"{AOT_MODULE}.so"
    try:
        resolved = Path(resolve(AOT_MODULE))
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        return Check("flashinfer fused-MoE AOT", "FAIL", f"cannot ask FlashInfer: {type(exc).__name__}: {exc}")
    arch = aot.get("cuda_arch_list", "?")
    if aot.get("status") == "built":
        if resolved != expected or not resolved.is_file():
            return Check("flashinfer fused-MoE AOT", "FAIL",
                         f"FlashInfer resolves {resolved}, the build put it at {expected}")
        import hashlib
        if hashlib.sha256(resolved.read_bytes()).hexdigest() != aot.get("sha256"):
            return Check("flashinfer fused-MoE AOT", "FAIL", f"{resolved}: sha256 differs from the build record")
        return Check("flashinfer fused-MoE AOT", "PASS", f"{AOT_MODULE} for {arch} -> {resolved}")
    if resolved.is_file():
        return Check("flashinfer fused-MoE AOT", "FAIL",
                     f"{resolved} exists but the build recorded status {aot.get('status')!r}")
    reason = aot.get("reason", "no build record")
    return Check("flashinfer fused-MoE AOT", "WARN",
                 f"MISSING {AOT_MODULE} for {arch}: {reason}. {aot.get('consequence', '')}")


def check_artifact_set(aot: dict, environ: dict[str, str]) -> Check:
    """What the image is. A release (the build's status ``built``) carries FlashInfer's artifact set
    where FLASHINFER_CUBIN_DIR points, complete for its FlashInfer's pins, and tells vLLM so
    (VLLM_HAS_FLASHINFER_CUBIN=1); a development image says so, and must not claim a set."""
    from .flashinfer_aot import DEVELOPMENT, check_cubin_dir, pinned_artifacts, set_summary

    name = "image kind"
    cubin_dir = environ.get("FLASHINFER_CUBIN_DIR", "")
    claims = environ.get("VLLM_HAS_FLASHINFER_CUBIN", "0")
    if aot.get("status") != "built":
        if claims not in ("", "0") and (not cubin_dir or check_cubin_dir(cubin_dir)):
            return Check(name, "FAIL", f"VLLM_HAS_FLASHINFER_CUBIN={claims}, but there is no complete artifact set "
                         f"(FLASHINFER_CUBIN_DIR={cubin_dir!r}): vLLM would take cubins as present that are not")
        recorded = f"{aot.get('status', 'nothing')!r}: {aot.get('reason', 'no build record')}"
        return Check(name, "WARN", f"{DEVELOPMENT} (the flashinfer-wheel stage recorded {recorded}); "
                     "`make image RELEASE=1` refuses to make such an image")
    problems = check_cubin_dir(cubin_dir, pinned=pinned_artifacts(aot))
    if cubin_dir != aot.get("cubin_dir"):
        problems.insert(0, f"FLASHINFER_CUBIN_DIR={cubin_dir!r}, but the build put the set at {aot.get('cubin_dir')}")
    if claims != "1":
        problems.append(f"VLLM_HAS_FLASHINFER_CUBIN={claims!r}: vLLM would probe FlashInfer's store instead of "
                        "taking the baked set")
    if problems:
        return Check(name, "FAIL", "release image, but " + "; ".join(problems[:3])
                     + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""))
    return Check(name, "PASS", f"release: {set_summary(cubin_dir)} in {cubin_dir} for this FlashInfer's pins, "
                 "VLLM_HAS_FLASHINFER_CUBIN=1")


# NIXL backends the presets select: LIBFABRIC (EFA, prefill and decode on p6-b300) and UCX
# (bundled in the wheel; InfiniBand/RoCE). Both must load in the image. The wheel's other
# plugins (GDS, GPUNETIO/DOCA, object stores, ...) load only when asked for and may lack their
# vendor libraries: reported, not failed.
NIXL_REQUIRED = ("UCX", "LIBFABRIC")
# nixl-cu13 1.4.1's LIBFABRIC plugin links libfabric.so.1 at FABRIC_1.7 (bookworm's 1.17 stops
# at FABRIC_1.5); the image carries libfabric 2.1.0 (the Dockerfile's libfabric stage) at
# /opt/libfabric/lib. It also links libhwloc.so.15, libcudart.so.13 (torch's nvidia wheels,
# loaded by torch before NIXL in vLLM's process) and the driver's libcuda.so.1.
NIXL_LIBFABRIC = "LIBFABRIC"
NIXL_LIBFABRIC_ABI = "FABRIC_1.7"
IMAGE_LIBFABRIC = Path("/opt/libfabric/lib/libfabric.so.1")
# libfabric providers NIXL over EFA needs (efa; shm for peers on one node) and the fallbacks.
LIBFABRIC_PROVIDERS = ("efa", "shm", "tcp", "ofi_rxm", "verbs")
# Provided on a GPU node by the NVIDIA container runtime, never by the image.
DRIVER_LIBS = ("libcuda.so.1",)


def nixl_plugins(site: Path) -> list[Path]:
    """The plugins NIXL loads: those in a plugins/ folder beside a libnixl.so. (nixl-cu13 also
    carries auditwheel copies under nixl_cu13.libs/nixl/ that NIXL does not load and that do
    not resolve on their own.)"""
    return sorted(p for p in site.rglob("libplugin_*.so")
                  if "nixl" in str(p).lower() and (p.parent.parent / "libnixl.so").is_file())


NIXL_PROBE = """
import json, sys
try:
    import torch  # as in vLLM's process: loads the CUDA runtime the plugins link
except Exception:
    pass
# NIXL the way vLLM's NixlConnector loads it (vllm.distributed.nixl_utils imports
# nixl._api, the meta package, which picks nixl_cu13 for torch's CUDA 13).
from vllm.distributed import nixl_utils
nixl_agent, nixl_agent_config = nixl_utils.NixlWrapper, nixl_utils.nixl_agent_config
if nixl_agent is None or nixl_agent_config is None:
    raise SystemExit("vLLM's NIXL loader (vllm.distributed.nixl_utils) found no NIXL: "
                     "the nixl package it imports as nixl._api is missing")
agent = nixl_agent("glm53-self-test", nixl_agent_config(backends=[]))
out = {}
for name in sys.argv[1:]:
    try:
        agent.create_backend(name)
        out[name] = "ok"
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def driver_stub_dir(cuda_home: str | None = None) -> Path | None:
    """Without an NVIDIA driver (CI, a CPU node), a folder whose libcuda.so.1 is the toolkit's
    link stub (every entry point returns CUDA_ERROR_STUB_LIBRARY), so that a plugin linking the
    driver can be loaded and its backend created; None when there is no stub."""
    stub = Path(cuda_home or os.environ.get("CUDA_HOME", "/opt/cuda")) / "lib64" / "stubs" / "libcuda.so"
    if not stub.is_file():
        return None
    folder = Path(tempfile.mkdtemp(prefix="glm53-driver-stub-"))
    (folder / "libcuda.so.1").symlink_to(stub.resolve())
    return folder


def probe_nixl_backends(names: tuple[str, ...], python: str = sys.executable) -> tuple[dict[str, str], str]:
    """Instantiate each NIXL backend in a fresh interpreter (no GPU needed): what the
    NixlConnector does at start. Returns 'ok' or the error per backend, and a note: when the
    driver is absent and the probe loaded the toolkit's libcuda stub instead, or when the
    probe's interpreter died after answering (nixl-cu13 with a UCX backend can end in SIGSEGV
    at interpreter exit in a container without RDMA devices)."""
    env = dict(os.environ)
    notes = []
    stub = None if driver_present() else driver_stub_dir()
    if stub is not None:
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(stub), env.get("LD_LIBRARY_PATH")]))
        notes.append("no NVIDIA driver here: libcuda.so.1 was the toolkit's link stub")
    try:
        proc = subprocess.run([python, "-c", NIXL_PROBE, *names], capture_output=True, text=True, timeout=120, env=env)
    finally:
        if stub is not None:
            shutil.rmtree(stub, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {name: f"probe failed: {tail}" for name in names}, "; ".join(notes)
    if proc.returncode < 0:
        notes.append(f"the probe died by signal {-proc.returncode} at exit, after answering")
    elif proc.returncode > 0:
        notes.append(f"the probe exited {proc.returncode} after answering")
    return json.loads(lines[-1]), "; ".join(notes)


def fabric_devices(net: Path = Path("/sys/class/net"), infiniband: Path = Path("/dev/infiniband")) -> list[str]:
    """What libfabric can open a NIXL rail on: RDMA devices (EFA, verbs) or a network interface
    other than loopback (its tcp provider; under ``--network=none`` it cannot listen on lo)."""
    found = [p.name for p in sorted(infiniband.glob("uverbs*"))] if infiniband.is_dir() else []
    if net.is_dir():
        found += [p.name for p in sorted(net.iterdir()) if p.name != "lo"]
    return found


# NIXL's answer when a plugin loaded but its engine could not be created (NIXL_ERR_NOT_FOUND: no plugin).
NIXL_BACKEND_ERROR = "NIXL_ERR_BACKEND"


def check_nixl_backends(results: dict[str, str], note: str = "", required: tuple[str, ...] = NIXL_REQUIRED,
                        devices: list[str] | None = None) -> Check:
    """Every preset backend instantiated: PASS. LIBFABRIC's plugin loaded but with nothing to open
    a rail on (no EFA device and only loopback: a build or CI container with --network=none): WARN,
    saying so; anything else: FAIL."""
    suffix = f" ({note})" if note else ""
    bad = {n: results.get(n, "not probed") for n in required if results.get(n) != "ok"}
    devices = fabric_devices() if devices is None else devices
    no_fabric = {n for n, r in bad.items() if n == NIXL_LIBFABRIC and NIXL_BACKEND_ERROR in r and not devices}
    if set(bad) - no_fabric:
        return Check("nixl backends", "FAIL", "; ".join(f"{n}: {r}" for n, r in bad.items()) + suffix)
    if no_fabric:
        ok = ", ".join(n for n in required if n not in no_fabric)
        return Check("nixl backends", "WARN", f"{ok} instantiated by NIXL; LIBFABRIC's plugin loaded but found no "
                     f"fabric to open a rail on ({results[NIXL_LIBFABRIC]}: no EFA device and only loopback here, "
                     f"e.g. --network=none); with a network or the EFA devices it is created{suffix}")
    return Check("nixl backends", "PASS", f"{', '.join(required)} instantiated by NIXL{suffix}")


def check_libfabric_providers(fi_info: str = "fi_info") -> Check:
    """The image's libfabric lists the EFA provider (and the ones NIXL falls back to); on a
    node without EFA devices fi_info -l still lists every provider that was built."""
    try:
        proc = subprocess.run([fi_info, "-l"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("libfabric providers", "FAIL", f"{fi_info} -l: {exc}")
    listed = [line[:-1] for line in proc.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    missing = [p for p in LIBFABRIC_PROVIDERS if p not in listed]
    if proc.returncode != 0 or missing:
        return Check("libfabric providers", "FAIL",
                     f"{fi_info} -l (exit {proc.returncode}) lacks {', '.join(missing) or '?'}: "
                     f"{', '.join(listed) or proc.stderr.strip()[-300:]}")
    return Check("libfabric providers", "PASS", ", ".join(listed))


def _plugin_name(path: Path) -> str:
    return path.name.removeprefix("libplugin_").removesuffix(".so")


def _ldd_env(path: Path) -> dict[str, str]:
    """ldd as the plugin loads in vLLM's process: torch has loaded the CUDA 13 runtime of
    its nvidia wheels (site-packages/nvidia/cu13/lib) before NIXL opens a plugin."""
    env = dict(os.environ)
    cuda = path.parents[2] / "nvidia" / "cu13" / "lib"
    if cuda.is_dir():
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [env.get("LD_LIBRARY_PATH"), str(cuda)]))
    return env


def _ldd(path: Path) -> str:
    proc = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=_ldd_env(path))
    return proc.stdout + proc.stderr


def _unresolved(path: Path) -> list[str]:
    """Unresolved libraries and missing symbol versions, less the driver's own libraries."""
    missing = []
    for line in _ldd(path).splitlines():
        if "not found" not in line:
            continue
        name = line.split("=>")[0].strip()
        if name not in DRIVER_LIBS:
            missing.append(name)
    return missing


def check_ldd(plugins: list[Path], required: tuple[str, ...] = NIXL_REQUIRED,
              image_libfabric: Path = IMAGE_LIBFABRIC) -> Check:
    if not plugins:
        return Check("nixl plugins ldd", "FAIL", "no NIXL plugin (libplugin_*.so) found")
    names = sorted({_plugin_name(p) for p in plugins})
    absent = [r for r in required if r not in names]
    if absent:
        return Check("nixl plugins ldd", "FAIL", f"required plugin(s) {', '.join(absent)} not in the wheel")
    missing_required: dict[str, list[str]] = {}
    missing_optional: dict[str, list[str]] = {}
    for plugin in plugins:
        name = _plugin_name(plugin)
        libs = _unresolved(plugin)
        if libs:
            (missing_required if name in required else missing_optional).setdefault(name, libs)
    fabric = next((p for p in plugins if _plugin_name(p) == NIXL_LIBFABRIC), None)
    out = _ldd(fabric) if fabric else ""
    hit = re.search(r"libfabric\.so\.1 => (\S+)", out)
    if missing_required:
        parts = []
        for name, libs in missing_required.items():
            version = re.search(r"version `([^']+)' not found", " ".join(libs))
            if name == NIXL_LIBFABRIC and version:
                parts.append(f"{name}: needs {version.group(1)}, which {hit.group(1) if hit else 'libfabric.so.1'} "
                             f"lacks (the image's libfabric is {image_libfabric}: is another libfabric.so.1 "
                             "first on LD_LIBRARY_PATH?)")
            else:
                parts.append(f"{name}: {', '.join(libs)}")
        return Check("nixl plugins ldd", "FAIL", f"unresolved: {'; '.join(parts)}")
    driver = [lib for lib in DRIVER_LIBS if re.search(rf"{re.escape(lib)} => not found", out)]
    driver_note = f"; {', '.join(driver)} comes from the NVIDIA driver at run time" if driver else ""
    optional = ("; optional plugins without their libraries: "
                + ", ".join(f"{k} ({', '.join(v[:2])})"
                            for k, v in sorted(missing_optional.items()))) if missing_optional else ""
    where = hit.group(1) if hit else "?"
    origin = ("" if Path(where) == image_libfabric or where == str(image_libfabric)
              else f" (not the image's {image_libfabric}: an override)")
    return Check("nixl plugins ldd", "PASS", f"{', '.join(required)} resolve every library; {NIXL_LIBFABRIC}: "
                 f"libfabric.so.1 => {where}{origin}{driver_note}{optional}")


FLASHINFER_PROBE = """
import json, os, re, subprocess
out = {}
import vllm.utils.flashinfer as vf
for key in ("has_flashinfer", "has_flashinfer_trtllm_fused_moe"):
    try:
        out[key] = bool(getattr(vf, key)())
    except Exception as exc:
        out[key] = False
        out[key + "_error"] = f"{type(exc).__name__}: {exc}"
try:
    from flashinfer.jit.cpp_ext import get_cuda_path
    out["cuda_path"] = get_cuda_path()
    text = subprocess.run([os.path.join(out["cuda_path"], "bin", "nvcc"), "--version"],
                          capture_output=True, text=True).stdout
    found = re.search(r"release (\\d+\\.\\d+),", text)
    out["nvcc_release"] = found.group(1) if found else None
except Exception as exc:
    out["cuda_path_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def probe_flashinfer(python: str = sys.executable, timeout: int = 300) -> dict:
    """vLLM's and FlashInfer's own answers, in a fresh interpreter with this environment."""
    proc = subprocess.run([python, "-c", FLASHINFER_PROBE], capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(lines[-1])


def check_flashinfer_in_vllm(result: dict, release: str = "13.0") -> Check:
    """FAIL unless vLLM would use FlashInfer (has_flashinfer: the package plus nvcc on PATH or
    flashinfer-cubin) and its TRTLLM fused MoE, and FlashInfer's JIT finds a CUDA ``release`` nvcc."""
    name = "flashinfer in vllm"
    if "error" in result:
        return Check(name, "FAIL", f"probe failed: {result['error']}")
    problems = [f"vLLM's {key}() is False" + (f" ({result[key + '_error']})" if result.get(key + "_error") else "")
                for key in ("has_flashinfer", "has_flashinfer_trtllm_fused_moe") if not result.get(key)]
    if "cuda_path_error" in result:
        problems.append(f"FlashInfer's get_cuda_path(): {result['cuda_path_error']}")
    elif result.get("nvcc_release") != release:
        problems.append(f"FlashInfer's get_cuda_path() is {result.get('cuda_path')}, whose nvcc is "
                        f"{result.get('nvcc_release') or 'missing'}, want {release}")
    if problems:
        return Check(name, "FAIL", "; ".join(problems) + " (the presets pin moe-backend flashinfer_trtllm: "
                     "vLLM would refuse to start)")
    return Check(name, "PASS", f"has_flashinfer, has_flashinfer_trtllm_fused_moe True; FlashInfer JIT: "
                 f"{result['cuda_path']}/bin/nvcc {release}")


def check_installed_files(site: Path) -> Check:
    from .distfiles import check_site, describe

    ok, detail = describe(check_site(site), site)
    return Check("installed files", "PASS" if ok else "FAIL", detail)


def check_torch(pinned_cuda: str) -> Check:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return Check("torch cuda build", "FAIL", f"import torch: {exc}")
    cuda = torch.version.cuda or "none"
    if not cuda.startswith(pinned_cuda):
        return Check("torch cuda build", "FAIL",
                     f"torch {torch.__version__} is built for CUDA {cuda}, want {pinned_cuda}")
    return Check("torch cuda build", "PASS", f"torch {torch.__version__} CUDA {cuda} (no GPU needed for this check)")


DPKG_STATUS = Path("/var/lib/dpkg/status")


def check_debian(home: Path, status_path: Path = DPKG_STATUS) -> Check:
    """Every installed Debian package at the version build/lock/debian.txt pins ([base] + [runtime])."""
    from .aptpin import parse_lock
    from .sbom import dpkg_installed
    try:
        sections = parse_lock((home / "lock" / "debian.txt").read_text())
        pkgs = {p["Package"]: p.get("Version", "") for p in dpkg_installed(status_path.read_text())}
    except (OSError, ValueError, RuntimeError) as exc:
        return Check("debian packages", "FAIL", f"{type(exc).__name__}: {exc}")
    locked: dict[str, str] = {}
    for stage in ("base", "runtime"):
        locked.update({n: v for n, (v, _) in sections.get(stage, ([], {}))[1].items()})
    off = [f"{n} {v} (lock: {locked.get(n, 'not locked')})" for n, v in sorted(pkgs.items()) if locked.get(n) != v]
    updates = sorted(f"{n} {v}" for n, v in pkgs.items() if re.search(r"\+deb\d+u\d+", v))
    listing = ", ".join(f"{n} {v}" for n, v in sorted(pkgs.items()))
    if off:
        return Check("debian packages", "FAIL",
                     f"{len(off)} of {len(pkgs)} not at the locked version: {'; '.join(off[:8])}")
    return Check("debian packages", "PASS", f"{len(pkgs)} installed, all at build/lock/debian.txt's versions "
                 f"(bookworm + updates + security; {len(updates)} at a +debNuM update); {listing}")


def check_files(home: Path, config_root: Path) -> list[Check]:
    out = []
    try:
        manifest = json.loads((home / "manifest.json").read_text())
        sbom = json.loads((home / "sbom.cdx.json").read_text())
        from .sbom import count_kinds, dpkg_installed
        kinds = count_kinds(sbom)
        n = kinds["pypi"]
        dists = {(re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(), d.version)
                 for d in md.distributions() if d.metadata["Name"]}
        debs = len(dpkg_installed(DPKG_STATUS.read_text())) if DPKG_STATUS.is_file() else 0
        from .sbom import SOURCE_BUILT
        built = sum(Path(e["path"]).is_file() for e in SOURCE_BUILT)
        status = "PASS" if sbom.get("bomFormat") == "CycloneDX" and n == len(dists) and kinds["deb"] == debs \
            and kinds["bundled"] > 0 and kinds["source"] == built else "FAIL"
        out.append(Check("manifest+sbom", status, f"manifest schema {manifest.get('schema')}, CycloneDX "
                         f"{sbom.get('specVersion')}: {n} Python components for {len(dists)} installed packages, "
                         f"{kinds['deb']} Debian for {debs} installed, "
                         f"{kinds['bundled']} native libraries bundled in wheels, "
                         f"{kinds['source']} built from source for {built} present"))
    except (OSError, ValueError, KeyError) as exc:
        out.append(Check("manifest+sbom", "FAIL", str(exc)))
    need = [config_root / r / "vllm.yaml" for r in ("prefill", "decode", "aggregated")]
    need += [home / "pd-proxy" / "toy_proxy_server.py"]
    need += [home / "scripts" / t
             for t in ("replay", "valkey-stats", "needle", "profile-capture", "kv-sizing", "entrypoint")]
    missing = [str(p) for p in need if not p.is_file()]
    out.append(Check("presets+tools", "FAIL" if missing else "PASS",
                     f"missing {', '.join(missing)}" if missing
                     else "prefill/decode/aggregated presets, pd-proxy, 5 tools"))
    cache_vars = ("HF_HOME", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "VLLM_CACHE_ROOT")
    bad = []
    for var in cache_vars:
        path = Path(os.environ.get(var, "/nonexistent"))
        probe = path if path.exists() else path.parent
        if not os.access(probe, os.W_OK):
            bad.append(f"{var}={path}")
    out.append(Check("writable caches", "FAIL" if bad else "PASS",
                     f"not writable: {', '.join(bad)}" if bad
                     else f"{', '.join(cache_vars)} writable as uid {os.getuid()}"))
    return out


def runtime_checks(home: Path, config_root: Path) -> list[Check]:
    manifest = json.loads((home / "manifest.json").read_text())
    pins = _pin_versions(manifest)
    site = Path(sysconfig.get_paths()["purelib"])
    trees = {name: json.loads((home / "trees" / f"{name}.json").read_text()) for name in ("lmcache", "flashinfer")}
    checks = [Check("python", "PASS" if sys.version_info[:2] == (3, 11) else "FAIL", sys.version.split()[0])]
    checks.append(check_version("vllm", _installed_version("vllm"), pins.get("vllm")))
    checks.append(check_version("torch", _installed_version("torch"), pins.get("torch")))
    checks.append(check_version("nixl-cu13", _installed_version("nixl-cu13"), pins.get("nixl-cu13")))
    checks.append(check_version("lmcache", _installed_version("lmcache"), pins.get("lmcache"),
                                local=f"glm53.{trees['lmcache']['patched_tree'][:12]}"))
    checks.append(check_version("flashinfer-python", _installed_version("flashinfer-python"),
                                pins.get("flashinfer-python")))
    checks.append(check_torch("13.0"))
    checks.append(check_flashinfer_in_vllm(probe_flashinfer()))
    checks.append(check_installed_files(site))
    checks.append(compare_tree("lmcache", trees["lmcache"], site, "lmcache", generated=GENERATED["lmcache"]))
    checks.append(compare_tree("flashinfer", trees["flashinfer"], site, "flashinfer", ("flashinfer/data",),
                               generated=GENERATED["flashinfer"]))
    # LMCache 0.5.5's CUDA extension (lmcache/v1/platform/cuda/device_ops.py imports lmcache.cuda_ops).
    ext = sorted((site / "lmcache").glob("cuda_ops*.so"))
    checks.append(Check("lmcache cuda ext", "PASS" if ext else "FAIL",
                        f"{ext[0].name}, {ext[0].stat().st_size / 1e6:.1f} MB" if ext
                        else "lmcache/cuda_ops*.so missing (built without BUILD_WITH_CUDA?)"))
    aot = json.loads((home / "flashinfer-aot.json").read_text())
    checks.append(check_aot(aot, site))
    checks.append(check_artifact_set(aot, dict(os.environ)))
    checks.append(check_ldd(nixl_plugins(site)))
    checks.append(check_libfabric_providers())
    checks.append(check_nixl_backends(*probe_nixl_backends(NIXL_REQUIRED)))
    checks.append(check_requirements())
    checks.append(check_pd_router())
    checks.extend(check_files(home, config_root))
    checks.append(check_debian(home))
    checks.append(check_presets(config_root))
    checks.append(check_deploy(config_root))
    return checks


def preset_files(config_root: Path) -> list[Path]:
    files = []
    for role in ROLES:
        files += [config_root / role / name for name in ("vllm.yaml", "lmcache.yaml", "env")
                  if (config_root / role / name).is_file()]
    return files


def check_presets(config_root: Path, python: str = sys.executable, timeout: int = 600) -> Check:
    """The role presets through configs/validate.py with this image's own vLLM and LMCache:
    vLLM's serve parser and engine args, LMCache's loader and validate (no GPU needed)."""
    validator = config_root / "validate.py"
    files = preset_files(config_root)
    if not validator.is_file() or not files:
        return Check("presets validate", "FAIL", f"missing {validator if not validator.is_file() else 'preset files'}")
    try:
        proc = subprocess.run([python, str(validator), *map(str, files)], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONHASHSEED": "0"})
    except subprocess.TimeoutExpired:
        return Check("presets validate", "FAIL", f"{validator} did not finish in {timeout} s")
    if proc.returncode == 0:
        return Check("presets validate", "PASS", f"{len(files)} files ({', '.join(ROLES)}) accepted by vLLM's "
                     "parser and engine args and LMCache's loader, in this image")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")] or proc.stderr.splitlines()[-3:]
    return Check("presets validate", "FAIL", "; ".join(errors[:3]))


# A placeholder digest for the self-test's render: the image cannot know its own digest, and
# the chart refuses an image by tag.
PLACEHOLDER_IMAGES = ("image=glm53-b300-serving@sha256:" + "0" * 64,
                      "valkeySpec.image=valkey/valkey@sha256:" + "0" * 64)


def _helm_available() -> bool:
    import shutil

    helm = os.environ.get("DIST_HELM")
    return bool(helm and Path(helm).is_file()) or shutil.which("helm") is not None


def check_chart_files(chart: Path) -> Check:
    """Without Helm (the image carries none): the chart's values validate against its own
    values.schema.json, and the engine configs its files/ links name are there."""
    import jsonschema
    import yaml

    for name in ("Chart.yaml", "values.yaml", "values.schema.json", "templates"):
        if not (chart / name).exists():
            return Check("deploy chart", "FAIL", f"missing {chart / name}")
    values = yaml.safe_load((chart / "values.yaml").read_text())
    schema = json.loads((chart / "values.schema.json").read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(values), key=lambda e: list(e.path))
    if errors:
        where = ".".join(str(p) for p in errors[0].path) or "values"
        return Check("deploy chart", "FAIL", f"{chart / 'values.yaml'}: {where}: {errors[0].message}")
    broken = sorted(str(p) for p in (chart / "files").rglob("*") if not p.exists())
    if broken:
        return Check("deploy chart", "FAIL", f"chart files that do not resolve: {', '.join(broken)}")
    templates = len(list((chart / "templates").glob("*")))
    return Check("deploy chart", "PASS", f"{chart}: values valid against values.schema.json, {templates} templates "
                 "(no helm in the image: render it with `helm template` or make image-check)")


def check_deploy(config_root: Path, python: str = sys.executable) -> Check:
    """The Kubernetes deployment (the Helm chart) renders from the shipped files, or, where no
    Helm is installed (the image), its values validate against the chart's schema."""
    import tempfile

    chart = config_root / "deploy" / "chart"
    render = config_root / "deploy" / "render.py"
    if not render.is_file() or not chart.is_dir():
        return Check("deploy render", "FAIL", f"missing {render if not render.is_file() else chart}")
    if not _helm_available():
        return check_chart_files(chart)
    with tempfile.TemporaryDirectory() as out:
        command = [python, str(render), "--configs", str(config_root), "--out", out]
        for assignment in PLACEHOLDER_IMAGES:
            command += ["--set", assignment]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
        written = sorted(p.name for p in Path(out).iterdir())
    if proc.returncode != 0 or not written:
        return Check("deploy render", "FAIL", (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1])
    return Check("deploy render", "PASS", f"{len(written)} manifests from {chart}")


NOT_INSTALLED_LINE = re.compile(r"^# left out \(not installed: (?P<why>.*)\): (?P<name>\S+)$")
UNMET_LINE = re.compile(r"^(?P<dist>\S+) (?P<version>\S+) requires (?P<name>\S+), which is not installed\.$")


def not_installed(lock: Path) -> dict[str, str]:
    """What the image's lock resolved but leaves out on purpose, with why
    (build/distbuild/host/lock.py IMAGE_NOT_INSTALLED writes these lines)."""
    if not lock.is_file():
        return {}
    found = {}
    for line in lock.read_text().splitlines():
        match = NOT_INSTALLED_LINE.match(line)
        if match:
            found[match["name"].lower().replace("_", "-")] = match["why"]
    return found


# The chart's routers (configs/deploy values router.vllmRouter.command): the P/D router and the
# prefill-retry router beside it (regular mode), and the flags they render.
ROUTER_FLAGS = ("--vllm-pd-disaggregation", "--service-discovery", "--prefill-selector", "--decode-selector",
                "--health-check-interval-secs", "--selector", "--retry-max-retries", "--cb-failure-threshold",
                "--cb-timeout-duration-secs")


def check_pd_router(python: str = sys.executable) -> Check:
    """vllm-router loads (its Rust extension) and takes the flags the chart passes it."""
    try:
        proc = subprocess.run([python, "-m", "vllm_router.launch_router", "--help"], capture_output=True,
                              text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("pd router", "FAIL", f"{python} -m vllm_router.launch_router: {exc}")
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return Check("pd router", "FAIL", f"{python} -m vllm_router.launch_router --help: {tail}")
    missing = [f for f in ROUTER_FLAGS if f not in proc.stdout]
    if missing:
        return Check("pd router", "FAIL", f"vllm-router {_installed_version('vllm-router') or '?'} lacks "
                     f"{', '.join(missing)}, which the chart passes")
    return Check("pd router", "PASS", f"vllm-router {_installed_version('vllm-router') or '?'}: "
                 f"python3 -m vllm_router.launch_router takes the chart's flags")


def check_requirements(python: str = sys.executable, lock: Path = HOME / "lock" / "image.txt") -> Check:
    """pip's own check that every installed distribution's requirements are met here,
    markers evaluated on this interpreter (a derived image that adds packages keeps it).
    A requirement on a distribution the lock leaves out on purpose is accepted, with its reason."""
    proc = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    if proc.returncode == 0:
        return Check("requirements", "PASS", lines[0] if lines else "pip check: no broken requirements")
    left_out = not_installed(lock)

    def reason(line: str) -> str | None:
        match = UNMET_LINE.match(line)
        return left_out.get(match["name"].lower().replace("_", "-")) if match else None

    accepted = [f"{line} ({reason(line)})" for line in lines if reason(line)]
    lines = [line for line in lines if not reason(line)]
    if not lines and accepted:
        return Check("requirements", "PASS", "pip check: only requirements the lock leaves out on purpose: "
                     + "; ".join(accepted))
    shown = "; ".join(lines[:3]) + (f" (+{len(lines) - 3} more)" if len(lines) > 3 else "")
    return Check("requirements", "FAIL", f"pip check: {shown or f'exit {proc.returncode}'}")


def sources_checks(work: Path) -> list[Check]:
    checks = [Check("python", "PASS" if sys.version_info[:2] == (3, 11) else "FAIL", sys.version.split()[0])]
    manifest = json.loads((work / "manifest.json").read_text())
    for name, entry in sorted(manifest["upstreams"].items()):
        tree = work / "src" / name
        got = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD^{tree}"],
                             capture_output=True, text=True).stdout.strip()
        mapped = json.loads((work / "trees" / f"{name}.json").read_text())["patched_tree"]
        ok = got == entry.get("patched_tree") == mapped
        checks.append(Check(f"tree {name}", "PASS" if ok else "FAIL",
                            f"{len(entry['patches'])} patch(es), patched tree {got[:12]}"
                            + ("" if ok else f" != manifest {entry.get('patched_tree', '?')[:12]} "
                                             f"/ map {mapped[:12]}")))
    return checks


def render(checks: list[Check], title: str) -> str:
    width = max(len(c.name) for c in checks)
    lines = [title, "-" * len(title)]
    lines += [f"{c.status:4}  {c.name:<{width}}  {c.detail}" for c in checks]
    counts = {s: sum(c.status == s for c in checks) for s in ("PASS", "WARN", "FAIL")}
    lines.append(f"self-test: {counts['PASS']} pass, {counts['WARN']} warn, {counts['FAIL']} fail")
    return "\n".join(lines) + "\n"


def exit_code(checks: list[Check], strict: bool) -> int:
    bad = {"FAIL", "WARN"} if strict else {"FAIL"}
    return 1 if any(c.status in bad for c in checks) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="self-test", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--strict", action="store_true", help="a WARN fails too")
    p.add_argument("--stage", choices=("runtime", "sources"), default="runtime")
    p.add_argument("--work", type=Path, default=Path("/work"))
    args = p.parse_args(argv)
    try:
        checks = runtime_checks(HOME, CONFIG_ROOT) if args.stage == "runtime" else sources_checks(args.work)
    except (OSError, ValueError, KeyError) as exc:
        checks = [Check("self-test inputs", "FAIL", f"{type(exc).__name__}: {exc}")]
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        sys.stdout.write(render(checks, f"glm53-b300 image self-test ({args.stage})"))
    return exit_code(checks, args.strict)


if __name__ == "__main__":
    sys.exit(main())
