"""Preflight of a serving container, before any weight is read: ``IMAGE preflight ROLE MODEL``.

The entrypoint runs it before a role preset starts vLLM (``--skip-preflight`` or
``GLM53_SKIP_PREFLIGHT=1`` skip it). In seconds it checks what would otherwise fail minutes
into a start, or not at all:

- ``/dev/shm`` is large enough (Docker gives 64 MiB; NCCL over 8 GPUs fails there);
- ``/cache`` is writable by this UID;
- the JIT toolchain answers: ``$CUDA_HOME/bin/nvcc`` is CUDA 13.0, a C++ compiler and
  ``Python.h`` are there (FlashInfer, DeepGEMM and Triton compile at first use);
- the NIXL backends the role's preset names instantiate; with LIBFABRIC, libfabric's ``efa``
  provider enumerates every EFA device the pod was given (``fi_info -p efa``);
- FlashInfer's artifact set (``FLASHINFER_CUBIN_DIR``) is complete for this image's FlashInfer;
  without one (a development image) every role fails unless ``GLM53_FLASHINFER_DOWNLOAD=1``
  accepts the download at first use and FlashInfer's store answers within 5 s;
- where a GPU is visible: compute capability 10.3 (the image's kernels are sm_103a) and a
  CUDA 13 driver; without one, a warning that says the GPU checks were skipped;
- the model's ``config.json``: an architecture the presets serve (``GlmMoeDsaForCausalLM``)
  with the shapes their attention backend accepts; anything else is refused, naming why.

Each failure names its fix. Exit 1 on a FAIL.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .flashinfer_aot import DEVELOPMENT, check_cubin_dir, pinned_artifacts, set_summary
from .presets import ROLES

CONFIG_ROOT = Path(os.environ.get("GLM53_CONFIGS", "/etc/glm53"))
HOME = Path(os.environ.get("GLM53_HOME", "/opt/glm53"))
GIB = 1 << 30
# /dev/shm per role. NCCL's shared-memory transport between the 8 ranks and vLLM's
# shared-memory message queues live there; vLLM's own multi-GPU recipes run with
# --shm-size=16G (docs/serving/parallelism_scaling.md). The deployment gives 64Gi.
MIN_SHM = {"prefill": 16 * GIB, "decode": 16 * GIB, "aggregated": 16 * GIB}
SHM_FIX = ("run the container with --ipc=host, or --shm-size=64g (docker/podman); on Kubernetes mount a "
           "memory-backed emptyDir at /dev/shm (configs/deploy: shm_size)")
CUDA_RELEASE = "13.0"
SERVED_ARCHITECTURES = {
    "GlmMoeDsaForCausalLM": "MLA with DeepSeek-V3.2's sparse indexer (vLLM 0.31.0: vllm/models/deepseek_v32)",
}
HYBRID_WHY = ("GLM-5.3-Flash, vLLM 0.31.0's vllm/models/glm5next: a hybrid linear-attention (KDA) model "
              "(IsHybrid) that needs the hybrid KV cache manager, which the prefill preset's LMCacheConnectorV1 "
              "turns off and the decode preset disables to match it (NIXL pairs only equal HMA states); "
              "serve it without these presets")
REFUSED_ARCHITECTURES = {"Glm5NextForCausalLM": HYBRID_WHY, "Glm5NextForConditionalGeneration": HYBRID_WHY}
NIXL_FIXES = {
    "LIBFABRIC": "NIXL over EFA loads the image's libfabric 2.1.0 (/opt/libfabric/lib, FABRIC_1.7, efa provider) "
                 "and needs the EFA devices (--device /dev/infiniband/uverbs*, or the EFA device plugin's "
                 "vpc.amazonaws.com/efa resource); a libfabric.so.1 put first on LD_LIBRARY_PATH (a host mount) "
                 "must be 2.x; on InfiniBand/RoCE set backends: [UCX] on both roles (the chart: nixlBackends: [UCX], "
                 "configs/deploy/examples/infiniband.yaml)",
    "UCX": "UCX is bundled in nixl-cu13: a derived image that removed nixl_cu13.libs or its plugins breaks it",
}


@dataclass
class Check:
    name: str
    status: str   # PASS, WARN, FAIL
    detail: str
    fix: str = ""


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.0f} MiB"


def check_shm(role: str, path: Path = Path("/dev/shm"), minimum: int | None = None) -> Check:
    need = MIN_SHM.get(role, max(MIN_SHM.values())) if minimum is None else minimum
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return Check("shm", "FAIL", f"{path}: {exc.strerror}", SHM_FIX)
    have = st.f_blocks * st.f_frsize
    if have < need:
        return Check("shm", "FAIL", f"{path} is {_size(have)}; the {role} role needs at least {_size(need)} "
                     "(NCCL across 8 GPUs, vLLM's shared-memory queues)", SHM_FIX)
    return Check("shm", "PASS", f"{path} is {_size(have)} (>= {_size(need)})")


def _take_a_file(path: Path) -> None:
    """Create and remove a probe file in ``path``; OSError if the folder cannot take one."""
    with tempfile.NamedTemporaryFile(dir=path, prefix=".preflight-"):
        pass


def check_cache(path: Path = Path("/cache")) -> Check:
    fix = (f"mount a writable volume at {path} (docker: -v glm53-cache:{path}); for another UID make it group 0 "
           "with group write (chgrp -R 0, chmod -R g+rwX) or owned by that UID")
    try:
        path.mkdir(parents=True, exist_ok=True)
        _take_a_file(path)
    except OSError as exc:
        return Check("cache", "FAIL", f"{path} is not writable as uid {os.getuid()} gid {os.getgid()}: "
                     f"{exc.strerror}", fix)
    return Check("cache", "PASS", f"{path} writable as uid {os.getuid()}")


SCRATCH_FIX = ("with a read-only root the engines need a writable /tmp and HOME: docker/podman --read-only "
               "--tmpfs /tmp --tmpfs /home/serve; the chart mounts emptyDirs there (engineFiles)")


def check_scratch(environ: dict[str, str]) -> Check:
    """The temp folder (vLLM's and LMCache's ZMQ IPC sockets, Python's and Inductor's temp files)
    and HOME take a file: under a read-only root without their mounts, the engine fails late,
    in a worker, on the first socket or temp file."""
    folders = {"temp folder": Path(environ.get("TMPDIR") or "/tmp"), "HOME": Path(environ.get("HOME") or "/")}
    for what, path in folders.items():
        try:
            _take_a_file(path)
        except OSError as exc:
            return Check("tmp and home", "FAIL", f"{what} {path} is not writable as uid {os.getuid()}: "
                         f"{exc.strerror}", SCRATCH_FIX)
    return Check("tmp and home", "PASS", f"{folders['temp folder']} and {folders['HOME']} writable")


# RDMA registration of host memory (NIXL's UCX/EFA backends pinning the KV and LMCache's L1)
# is charged to RLIMIT_MEMLOCK unless the process holds CAP_IPC_LOCK in its effective set, which
# a non-root process (the image's uid 1000, the chart's pods) does not, whatever the pod adds.
CAP_IPC_LOCK = 14
MEMLOCK_FIX = ("run with an unlimited memlock: docker/podman --ulimit memlock=-1:-1; on Kubernetes the "
               "container runtime's limit is inherited (containerd/CRI-O: LimitMEMLOCK=infinity in its "
               "systemd unit, or the runtime's default ulimits)")


def effective_capabilities(status: Path = Path("/proc/self/status")) -> int:
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_memlock(backends: list[str], limits: tuple[int, int] | None = None, capabilities: int | None = None) -> Check:
    """A NIXL role needs memlock unlimited (or CAP_IPC_LOCK); a role without NIXL only notes it."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK) if limits is None else limits
    caps = effective_capabilities() if capabilities is None else capabilities
    has_cap = bool(caps >> CAP_IPC_LOCK & 1)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else _size(soft)
    cap_note = "CAP_IPC_LOCK effective" if has_cap else "no CAP_IPC_LOCK"
    if soft == resource.RLIM_INFINITY or has_cap:
        return Check("memlock", "PASS", f"RLIMIT_MEMLOCK {shown}, {cap_note}")
    if not backends:
        return Check("memlock", "WARN", f"RLIMIT_MEMLOCK {shown}, {cap_note}: pinned host memory may fail "
                     "(the preset uses no NIXL, so nothing registers it for RDMA)", MEMLOCK_FIX)
    return Check("memlock", "FAIL", f"RLIMIT_MEMLOCK {shown} and {cap_note}: NIXL's {', '.join(backends)} "
                 "registration of the KV and L1 would fail", MEMLOCK_FIX)


def nvcc_release(nvcc: Path, timeout: float = 30) -> str | None:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"release (\d+\.\d+),", out)
    return found.group(1) if found else None


def check_jit(environ: dict[str, str], release: str = CUDA_RELEASE,
              include_dir: str | None = None, which: Callable[[str], str | None] = shutil.which) -> Check:
    """FlashInfer's get_cuda_path() reads CUDA_HOME first; its ninja files call $CUDA_HOME/bin/nvcc
    and c++, and include sysconfig's include dir (Python.h), as Triton's launcher stub does."""
    fix = "the image's JIT toolchain is /opt/cuda (CUDA_HOME), g++ and python3-dev: a derived image must keep them"
    problems = []
    cuda_home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if not cuda_home:
        problems.append("CUDA_HOME is not set")
    else:
        got = nvcc_release(Path(cuda_home) / "bin" / "nvcc")
        if got != release:
            problems.append(f"{cuda_home}/bin/nvcc " + (f"is CUDA {got}, want {release}" if got else "does not answer"))
        # FlashInfer links every JIT module with -L$cuda_home/lib64/stubs -lcuda.
        if not (Path(cuda_home) / "lib64" / "stubs" / "libcuda.so").is_file():
            problems.append(f"no {cuda_home}/lib64/stubs/libcuda.so (FlashInfer's JIT links -lcuda)")
    compiler = environ.get("CXX") or which("c++") or which("g++")
    if not compiler:
        problems.append("no C++ compiler (c++/g++)")
    include = Path(include_dir or sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        problems.append(f"no {include}/Python.h")
    if problems:
        return Check("jit toolchain", "FAIL", "; ".join(problems), fix)
    return Check("jit toolchain", "PASS", f"nvcc {release} at {cuda_home}/bin, the libcuda link stub, {compiler}, "
                 f"{include}/Python.h")


def preset_nixl_backends(vllm_yaml: Path) -> list[str]:
    """The NIXL backends a preset's vllm.yaml selects (NixlConnector's default: UCX)."""
    import yaml

    data = yaml.safe_load(vllm_yaml.read_text()) or {}
    found: list[str] = []

    def visit(ktc: dict) -> None:
        if not isinstance(ktc, dict):
            return
        extra = ktc.get("kv_connector_extra_config") or {}
        if ktc.get("kv_connector") == "NixlConnector":
            found.extend(b for b in (extra.get("backends") or ["UCX"]) if b not in found)
        for child in extra.get("connectors") or []:
            visit(child)

    visit(data.get("kv-transfer-config") or data.get("kv_transfer_config") or {})
    return found


def check_nixl(backends: list[str], probe: Callable[[tuple[str, ...]], tuple[dict[str, str], str]],
               devices: list[str] | None = None, gpu_visible: bool = True) -> Check:
    """The preset's NIXL backends instantiate. On a GPU node LIBFABRIC also needs an RDMA device
    (EFA): without one libfabric falls back to TCP over the pod network, silently. Where no GPU
    is visible and there is no fabric at all (a CI container, --network=none), LIBFABRIC's plugin
    loading without a rail to open is a warning, as the GPU checks are."""
    if not backends:
        return Check("nixl backends", "PASS", "the preset uses no NIXL connector")
    from .selftest import NIXL_BACKEND_ERROR, fabric_devices

    devices = fabric_devices() if devices is None else devices
    results, note = probe(tuple(backends))
    bad = {b: results.get(b, "not probed") for b in backends if results.get(b) != "ok"}
    no_fabric = {b for b, why in bad.items() if b == "LIBFABRIC" and NIXL_BACKEND_ERROR in why
                 and not devices and not gpu_visible}
    if set(bad) - no_fabric:
        return Check("nixl backends", "FAIL", "; ".join(f"{b}: {why}" for b, why in bad.items()),
                     " ".join(NIXL_FIXES.get(b, f"the NIXL plugin for {b}") for b in bad))
    suffix = f" ({note})" if note else ""
    if no_fabric:
        return Check("nixl backends", "WARN", f"LIBFABRIC's plugin loaded but found no fabric to open a rail on "
                     f"(no EFA device, only loopback, no GPU visible: GPU checks skipped){suffix}",
                     NIXL_FIXES["LIBFABRIC"])
    if "LIBFABRIC" in backends and gpu_visible and not any(d.startswith("uverbs") for d in devices):
        return Check("nixl backends", "FAIL", "LIBFABRIC instantiated, but no RDMA device (/dev/infiniband/uverbs*) "
                     "is in the container: NIXL would move the KV over TCP", NIXL_FIXES["LIBFABRIC"])
    return Check("nixl backends", "PASS", f"{', '.join(backends)} instantiated{suffix}")


# ``fi_info -p efa``: libfabric's efa provider, one domain per EFA device and endpoint type
# (``<device>-rdm``, ``<device>-dgrm``; libfabric 2.x lists the rdm one under both its efa and
# efa-direct fabrics). Without EFA devices it prints ``fi_getinfo: -61 (No data available)``.
EFA_DEVICES_ENV = "GLM53_EFA_DEVICES"
EFA_DOMAIN = re.compile(r"^\s*domain:\s*(\S+?)(?:-rdm|-dgrm)?\s*$")
EFA_FIX = ("the image's libfabric 2.1.0 enumerates EFA devices through libibverbs and the efa provider of "
           "the image's rdma-core 56.1 (docs/image.md: NIXL over EFA): check `fi_info -p efa` and `ibv_devices` in the "
           "container, the EFA kernel driver on the node, and that the pod's vpc.amazonaws.com/efa devices "
           f"are all passed (--device /dev/infiniband/uverbsN); {EFA_DEVICES_ENV}=N states the count expected")


def requested_efa(environ: dict[str, str], infiniband: Path = Path("/dev/infiniband")) -> tuple[int, str]:
    """How many EFA devices the pod asked for: ``GLM53_EFA_DEVICES`` when set, else the
    ``uverbs*`` devices in the container (the EFA device plugin passes exactly the ones a pod's
    ``vpc.amazonaws.com/efa`` request was given). ValueError names a bad value."""
    value = environ.get(EFA_DEVICES_ENV, "").strip()
    if value:
        if not value.isdigit():
            raise ValueError(f"{EFA_DEVICES_ENV}={value!r} is not a device count")
        return int(value), f"{EFA_DEVICES_ENV}={int(value)}"
    found = sorted(p.name for p in infiniband.glob("uverbs*")) if infiniband.is_dir() else []
    return len(found), f"{len(found)} {infiniband}/uverbs* device(s) in the container"


def efa_devices(fi_info_output: str) -> list[str]:
    """The EFA devices in ``fi_info -p efa`` output (its default short format): the domain of each
    entry whose provider is efa, less the endpoint-type suffix, each once."""
    found: list[str] = []
    provider = ""
    for line in fi_info_output.splitlines():
        if line.startswith("provider:"):
            provider = line.split(":", 1)[1].strip()
            continue
        match = EFA_DOMAIN.match(line)
        if match and "efa" in provider.split(";") and match.group(1) not in found:
            found.append(match.group(1))
    return found


def run_fi_info(fi_info: str = "fi_info", timeout: float = 30) -> tuple[int, str]:
    """``fi_info -p efa``: exit status and output (127 and why when it cannot run)."""
    binary = shutil.which(fi_info)
    if binary is None:
        return 127, f"{fi_info}: not found on PATH (the image links /opt/libfabric/bin/fi_info into /usr/local/bin)"
    try:
        done = subprocess.run([binary, "-p", "efa"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, f"{binary} -p efa: {exc}"
    return done.returncode, done.stdout + done.stderr


def check_efa(backends: list[str], environ: dict[str, str], fi_info: Callable[[], tuple[int, str]] = run_fi_info,
              infiniband: Path = Path("/dev/infiniband"), gpu_visible: bool = True) -> Check:
    """With NIXL's LIBFABRIC backend, libfabric's efa provider must enumerate at least the EFA
    devices the pod asked for: a device it cannot open (libefa too old for it, a missing device
    node) leaves NIXL on fewer rails, and with none on TCP, without an error."""
    if "LIBFABRIC" not in backends:
        return Check("efa devices", "PASS", "the preset's NIXL backends do not use EFA")
    try:
        wanted, source = requested_efa(environ, infiniband)
    except ValueError as exc:
        return Check("efa devices", "FAIL", str(exc), f"{EFA_DEVICES_ENV} is the pod's vpc.amazonaws.com/efa count")
    if wanted == 0:
        return Check("efa devices", "FAIL" if gpu_visible else "WARN",
                     f"no EFA device asked for ({source}, {EFA_DEVICES_ENV} unset): LIBFABRIC would carry the KV "
                     "over TCP" + ("" if gpu_visible else " (no GPU visible: GPU checks skipped)"), EFA_FIX)
    status, output = fi_info()
    found = efa_devices(output) if status == 0 else []
    if len(found) < wanted:
        said = output.strip().splitlines()[-1] if output.strip() and not found else ", ".join(found)
        return Check("efa devices", "FAIL", f"fi_info -p efa enumerates {len(found)} EFA device(s) ({said or 'none'}), "
                     f"fewer than the {wanted} asked for ({source}): libfabric would use only those, or fall back "
                     "to TCP without an error", EFA_FIX)
    return Check("efa devices", "PASS", f"fi_info -p efa enumerates {len(found)} EFA device(s) "
                 f"({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}) for the {wanted} asked for ({source})")


DOWNLOAD_ENV = "GLM53_FLASHINFER_DOWNLOAD"
PROBE_TIMEOUT_S = 5.0
ARTIFACT_FIX = ("run a release image (`make flashinfer-artifacts`, then `make image RELEASE=1`), or mount a set "
                "`make flashinfer-artifacts` verified for this image's FlashInfer and set FLASHINFER_CUBIN_DIR to it "
                f"with VLLM_HAS_FLASHINFER_CUBIN=1; on a node that reaches FlashInfer's store, {DOWNLOAD_ENV}=1 "
                f"accepts the download at first use (the store must then answer within {PROBE_TIMEOUT_S:.0f} s)")


def image_aot_status(path: Path | None = None) -> dict:
    """The flashinfer-wheel stage's status file in the image ({} where there is none)."""
    try:
        return json.loads((path or HOME / "flashinfer-aot.json").read_text())
    except (OSError, ValueError):
        return {}


def probe_store(url: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """A GET of the store's base URL, as vLLM's own has_nvidia_artifactory() does, bounded to
    ``timeout`` seconds in all (name resolution included): (answered, what happened)."""
    result: list[tuple[bool, str]] = []

    def ask() -> None:
        started = time.monotonic()
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout) as answer:
                result.append((True, f"HTTP {answer.status} in {time.monotonic() - started:.1f} s"))
        except urllib.error.HTTPError as exc:
            result.append((False, f"HTTP {exc.code} {exc.reason}"))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            result.append((False, str(getattr(exc, "reason", None) or exc)))

    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    worker.join(timeout)
    return result[0] if result else (False, f"no answer within {timeout:.0f} s")


def check_flashinfer_artifacts(role: str, environ: dict[str, str], aot: dict | None = None,
                               probe: Callable[[str], tuple[bool, str]] = probe_store) -> Check:
    """FlashInfer's trtllm-gen headers and cubins, which every preset's pinned backends
    (flashinfer_trtllm MoE, FLASHINFER_MLA_SPARSE) need: a release image carries the set in
    FLASHINFER_CUBIN_DIR. A development image has none, and FlashInfer would fetch it at the first
    fused-MoE call, after the weights loaded: refused unless the operator accepts that
    (GLM53_FLASHINFER_DOWNLOAD=1) and the store answers now."""
    name = "flashinfer artifacts"
    aot = image_aot_status() if aot is None else aot
    cubin_dir = environ.get("FLASHINFER_CUBIN_DIR", "")
    if cubin_dir:
        problems = check_cubin_dir(cubin_dir, pinned=pinned_artifacts(aot))
        if problems:
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            return Check(name, "FAIL", f"FLASHINFER_CUBIN_DIR={cubin_dir}: {'; '.join(problems[:3])}{more}",
                         ARTIFACT_FIX)
        summary = f"{set_summary(cubin_dir)} in {cubin_dir}"
        if environ.get("VLLM_HAS_FLASHINFER_CUBIN") != "1":
            return Check(name, "WARN", f"{summary}, but VLLM_HAS_FLASHINFER_CUBIN is not 1: vLLM probes FlashInfer's "
                         "store before it uses TRTLLM attention and, without an answer, turns it off",
                         "set VLLM_HAS_FLASHINFER_CUBIN=1 beside FLASHINFER_CUBIN_DIR")
        return Check(name, "PASS", f"{summary}, VLLM_HAS_FLASHINFER_CUBIN=1")
    absent = (f"{DEVELOPMENT}: FLASHINFER_CUBIN_DIR is unset, so FlashInfer downloads its trtllm-gen headers and "
              "cubins at the first fused-MoE or sparse-MLA call, after the weights loaded")
    if environ.get(DOWNLOAD_ENV, "") != "1":
        return Check(name, "FAIL", f"{absent}; a node without access to its store fails there", ARTIFACT_FIX)
    store = environ.get("FLASHINFER_CUBINS_REPOSITORY") or aot.get("artifact_store")
    if not store:
        return Check(name, "FAIL", f"{absent}; {DOWNLOAD_ENV}=1, but no store to check: FLASHINFER_CUBINS_REPOSITORY "
                     "is unset and the image's flashinfer-aot.json names none", ARTIFACT_FIX)
    answered, how = probe(store)
    if not answered:
        return Check(name, "FAIL", f"{absent}; {DOWNLOAD_ENV}=1, but FlashInfer's store {store} did not answer: {how}",
                     ARTIFACT_FIX)
    return Check(name, "WARN", f"{absent}; {DOWNLOAD_ENV}=1 and FlashInfer's store {store} answered ({how}): "
                 f"the {role} engine downloads there at first use", ARTIFACT_FIX)


def nvidia_smi() -> str | None:
    """``nvidia-smi`` output (the header names the driver's CUDA version) plus one CSV line per GPU,
    or None where no GPU is visible."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        head = subprocess.run([binary], capture_output=True, text=True, timeout=30)
        rows = subprocess.run([binary, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if rows.returncode != 0 or not rows.stdout.strip():
        return None
    return head.stdout + "\n" + rows.stdout


def check_gpu(smi: str | None) -> Check:
    if smi is None:
        return Check("gpu", "WARN", "no GPU visible: compute capability and driver not checked (GPU checks skipped)",
                     "on a GPU node run with --gpus all (docker) or --device nvidia.com/gpu=all (podman, CDI)")
    cuda = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", smi)
    rows = [line.split(",") for line in smi.splitlines() if line.count(",") == 2]
    gpus = [(name.strip(), cap.strip(), drv.strip()) for name, cap, drv in rows]
    problems = []
    wrong = sorted({f"{n} (compute capability {c})" for n, c, _ in gpus if c != "10.3"})
    if wrong:
        problems.append(f"{', '.join(wrong)}: this image's kernels are sm_103a only (B300, compute capability 10.3)")
    if cuda is None or int(cuda.group(1)) < 13:
        driver = gpus[0][2] if gpus else "?"
        problems.append(f"driver {driver} supports CUDA {cuda.group(1) + '.' + cuda.group(2) if cuda else '?'}; "
                        "torch and the kernels here are CUDA 13 (driver R580 or newer)")
    if problems:
        return Check("gpu", "FAIL", "; ".join(problems),
                     "run on a B300 node (p6-b300) with an R580+ NVIDIA driver")
    return Check("gpu", "PASS",
                 f"{len(gpus)} x {gpus[0][0]} (10.3), driver {gpus[0][2]}, CUDA {cuda.group(1)}.{cuda.group(2)}")


def check_model(model: str | None, offline: bool = False) -> Check:
    """The model's config.json against what the presets serve (configs/README.md, "Kernels and model").
    ``offline``: HF_HUB_OFFLINE=1 (the presets set it), so a hub id is only looked up in HF_HOME."""
    fix = "serve GLM-5.3 FP8 (GlmMoeDsaForCausalLM) with these presets, or run `IMAGE vllm serve ...` without them"
    if not model:
        return Check("model", "FAIL", "no model given", "pass the model folder: IMAGE <role> /models/GLM-5.3-FP8")
    config_path = Path(model) / "config.json"
    if not Path(model).is_dir():
        how = ("with HF_HUB_OFFLINE=1 (the preset's) it must already be in HF_HOME's cache, nothing is downloaded"
               if offline else "its architecture is checked by vLLM only after it is downloaded")
        return Check("model", "WARN", f"{model} is not a local folder: {how}",
                     "mount the weights and pass the folder (-v /models:/models:ro)")
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        return Check("model", "FAIL", f"{config_path} missing",
                     "mount the model's whole folder (config.json with the weights)")
    except (OSError, ValueError) as exc:
        return Check("model", "FAIL", f"{config_path}: {exc}", "mount an intact copy of the model")
    archs = config.get("architectures") or []
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for arch in archs:
        if arch in REFUSED_ARCHITECTURES:
            return Check("model", "FAIL", f"{arch} is {REFUSED_ARCHITECTURES[arch]}", fix)
    served = [a for a in archs if a in SERVED_ARCHITECTURES]
    if not served:
        return Check("model", "FAIL", f"architectures {archs or 'missing'}: the presets serve "
                     f"{', '.join(SERVED_ARCHITECTURES)} only", fix)
    problems = []
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant != "fp8":
        problems.append(f"quantization_config.quant_method is {quant!r}: the presets serve the FP8 checkpoint "
                        "(moe-backend flashinfer_trtllm through vLLM's FP8 MoE oracle)")
    # FLASHINFER_MLA_SPARSE's own rules (vllm/v1/attention/backends/mla/flashinfer_mla_sparse.py).
    if "index_topk" not in text:
        problems.append("no index_topk: not a sparse-indexer model, "
                        "which attention-backend FLASHINFER_MLA_SPARSE needs")
    rope, nope, rank = text.get("qk_rope_head_dim"), text.get("qk_nope_head_dim"), text.get("kv_lora_rank")
    if rope == 0 and (nope, rank) != (256, 512):
        problems.append(f"no-rope MLA with qk_nope_head_dim={nope}, kv_lora_rank={rank}: "
                        "FLASHINFER_MLA_SPARSE needs 256/512")
    elif rope and nope not in (128, 192):
        problems.append(f"qk_nope_head_dim={nope}: FLASHINFER_MLA_SPARSE needs 128 or 192")
    if problems:
        return Check("model", "FAIL", f"{served[0]}: " + "; ".join(problems), fix)
    grid = f"top-{text.get('num_experts_per_tok', '?')} of {text.get('n_routed_experts', '?')} experts, " \
           f"{text.get('moe_intermediate_size', '?')} wide"
    return Check("model", "PASS", f"{served[0]} ({SERVED_ARCHITECTURES[served[0]]}), FP8, {grid}")


def run_checks(role: str, model: str | None, environ: dict[str, str], config_root: Path = CONFIG_ROOT,
               shm: Path = Path("/dev/shm"), cache: Path = Path("/cache"),
               probe: Callable | None = None, smi: Callable[[], str | None] = nvidia_smi,
               fi_info: Callable[[], tuple[int, str]] = run_fi_info, aot: dict | None = None,
               store_probe: Callable[[str], tuple[bool, str]] = probe_store) -> list[Check]:
    if probe is None:
        from .selftest import probe_nixl_backends as probe
    checks = [check_shm(role, shm), check_cache(cache), check_scratch(environ), check_jit(environ)]
    gpu = smi()
    vllm_yaml = config_root / role / "vllm.yaml"
    try:
        backends = preset_nixl_backends(vllm_yaml)
        checks.append(check_nixl(backends, probe, gpu_visible=gpu is not None))
        checks.append(check_efa(backends, environ, fi_info=fi_info, gpu_visible=gpu is not None))
        checks.append(check_memlock(backends))
    except (OSError, ValueError) as exc:
        checks.append(Check("nixl backends", "FAIL", f"{vllm_yaml}: {exc}",
                            "the image ships the presets in /etc/glm53"))
    checks.append(check_flashinfer_artifacts(role, environ, aot=aot, probe=store_probe))
    checks.append(check_gpu(gpu))
    checks.append(check_model(model, offline=environ.get("HF_HUB_OFFLINE") == "1"))
    return checks


def render(checks: list[Check], seconds: float) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"preflight: {c.status:4}  {c.name:<{width}}  {c.detail}")
        if c.status != "PASS" and c.fix:
            lines.append(f"preflight:       {'':<{width}}  fix: {c.fix}")
    fails = sum(c.status == "FAIL" for c in checks)
    lines.append(f"preflight: {'FAILED' if fails else 'ok'} in {seconds:.1f} s ({fails} fail, "
                 f"{sum(c.status == 'WARN' for c in checks)} warn); "
                 "skip with --skip-preflight or GLM53_SKIP_PREFLIGHT=1")
    return "\n".join(lines) + "\n"


def preflight(role: str, model: str | None, environ: dict[str, str], out=sys.stderr, **kwargs) -> int:
    started = time.monotonic()
    checks = run_checks(role, model, environ, **kwargs)
    out.write(render(checks, time.monotonic() - started))
    out.flush()
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="preflight", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=ROLES)
    p.add_argument("model", nargs="?", default=os.environ.get("MODEL"))
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="the shared-memory mount to measure")
    p.add_argument("--cache", type=Path, default=Path("/cache"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.json:
        checks = run_checks(args.role, args.model, dict(os.environ), shm=args.shm, cache=args.cache)
        print(json.dumps([asdict(c) for c in checks], indent=1))
        return 1 if any(c.status == "FAIL" for c in checks) else 0
    return preflight(args.role, args.model, dict(os.environ), out=sys.stdout, shm=args.shm, cache=args.cache)


if __name__ == "__main__":
    sys.exit(main())
