"""The container-start preflight (image/imagectl/preflight.py) on real parts: /dev/shm sizes
read with statvfs from real tmpfs mounts, real config.json files, a real nvcc (the pinned
toolchain's, when built here), the shipped presets, and the entrypoint that runs it.

The NIXL probe is the self-test's real probe in the image (tests/image/test_runtime_image.py);
here it is replaced by a function returning a probe's answer, since nixl-cu13 is not installed
in the test environment: the tests check what the preflight makes of an answer.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from distbuild import flashinfer_artifacts as fa
from imagectl import entrypoint, identity, preflight

from .conftest import REPO
from .test_flashinfer_artifacts import closed_port_url, http_mirror, make_store

CONFIGS = REPO / "configs"
TOOLCHAIN = REPO / "work" / "toolchain"
GIB = 1 << 30

# GLM-5's attention geometry (tests/lmcache/glm5_vllm_kv.py) with the write-up's MoE grid.
GLM5_FP8 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
    "index_topk": 2048, "num_experts_per_tok": 8, "n_routed_experts": 256, "moe_intermediate_size": 2048,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}


def model_dir(tmp_path: Path, config: dict | None, name: str = "model") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def tmpfs(tmp_path: Path):
    """A real tmpfs of a given size (root and mount(2) needed: both are there where make test runs)."""
    mounted: list[Path] = []

    def make(size: str) -> Path:
        where = tmp_path / f"shm-{size}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.fail(f"cannot mount a tmpfs here ({done.stderr.strip()}); the shm tests need root", pytrace=False)
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_docker_default_shm_is_refused_with_its_fix(tmpfs) -> None:
    check = preflight.check_shm("prefill", tmpfs("64m"))
    assert check.status == "FAIL"
    assert "is 64 MiB; the prefill role needs at least 16.0 GiB" in check.detail
    assert "--ipc=host" in check.fix and "--shm-size=64g" in check.fix


def test_a_large_enough_shm_passes(tmpfs) -> None:
    check = preflight.check_shm("decode", tmpfs("17g"))   # tmpfs size is a limit, nothing is allocated
    assert check.status == "PASS" and "17.0 GiB" in check.detail


def test_shm_threshold_is_read_from_statvfs(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    size = st.f_blocks * st.f_frsize
    assert preflight.check_shm("aggregated", tmp_path, minimum=size).status == "PASS"
    assert preflight.check_shm("aggregated", tmp_path, minimum=size + 1).status == "FAIL"
    assert preflight.check_shm("aggregated", tmp_path / "absent").status == "FAIL"


def test_cache_must_be_writable(tmp_path: Path) -> None:
    good = tmp_path / "cache"
    assert preflight.check_cache(good).status == "PASS"
    assert not any(good.iterdir())   # the probe file is gone
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):
            # root ignores mode bits: a read-only bind mount is a real read-only /cache for root.
            done = subprocess.run(["mount", "--bind", "-o", "ro", str(locked), str(locked)], capture_output=True)
            assert done.returncode == 0, done.stderr
            try:
                check = preflight.check_cache(locked)
            finally:
                subprocess.run(["umount", str(locked)], capture_output=True)
        else:
            check = preflight.check_cache(locked)
    finally:
        locked.chmod(0o755)
    assert check.status == "FAIL" and "not writable" in check.detail
    assert "-v glm53-cache:" in check.fix and "chmod -R g+rwX" in check.fix


def test_tmp_and_home_must_take_a_file_under_a_read_only_root(tmp_path: Path) -> None:
    """Run as the chart runs the engines (tests/support/read_only_root.py: root read-only, /tmp a
    tmpfs): HOME on the read-only root fails naming it and the fix, a writable HOME passes."""
    from tests.support import read_only_root

    home = tmp_path / "home"
    home.mkdir()
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from imagectl import preflight; "
            "c = preflight.check_scratch({'TMPDIR': '/tmp', 'HOME': sys.argv[2]}); print(json.dumps(c.__dict__))")
    verdicts = {}
    for name, given in (("read-only", str(REPO)), ("writable", str(home))):
        argv = read_only_root.command(sys.executable, [str(home)],
                                      [sys.executable, "-c", code, str(REPO / "image"), given])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        verdicts[name] = json.loads(done.stdout)
    assert verdicts["writable"]["status"] == "PASS", verdicts["writable"]
    failed = verdicts["read-only"]
    assert failed["status"] == "FAIL" and f"HOME {REPO} is not writable" in failed["detail"], failed
    assert "Read-only file system" in failed["detail"] and "--tmpfs /tmp --tmpfs /home/serve" in failed["fix"]


def _toolchain_home() -> Path:
    found = sorted(TOOLCHAIN.glob("lib/python3*/site-packages/nvidia/cu13"))
    if not found or not (found[0] / "bin" / "nvcc").is_file():
        pytest.fail("the pinned toolchain is not in work/toolchain (python -m distbuild toolchain makes it)",
                    pytrace=False)
    return found[0]


def _image_cuda_home(tmp_path: Path) -> Path:
    """Laid out as the image does: the pinned toolchain plus the libcuda stub the toolchain stage makes."""
    from imagectl import cudastub
    home = _toolchain_home()
    image_home = tmp_path / "cuda"
    image_home.mkdir()
    for name in ("bin", "include", "nvvm"):
        if (home / name).exists():
            (image_home / name).symlink_to(home / name)
    cudastub.build(home / "include" / "cuda.h", image_home / "lib64" / "stubs" / "libcuda.so")
    return image_home


def test_jit_toolchain_with_the_pinned_nvcc(tmp_path: Path) -> None:
    home = _toolchain_home()
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        pytest.fail(f"{include}/Python.h missing on this host", pytrace=False)
    assert preflight.nvcc_release(home / "bin" / "nvcc") == "13.0"
    # the toolchain's wheels alone have no libcuda stub: FlashInfer's -lcuda link would fail
    bare = preflight.check_jit({"CUDA_HOME": str(home)})
    assert bare.status == "FAIL" and bare.detail == f"no {home}/lib64/stubs/libcuda.so (FlashInfer's JIT links -lcuda)"
    image_home = _image_cuda_home(tmp_path)
    check = preflight.check_jit({"CUDA_HOME": str(image_home)})
    assert check.status == "PASS", check.detail
    wrong = preflight.check_jit({"CUDA_HOME": str(image_home)}, release="13.5")
    assert wrong.status == "FAIL" and "is CUDA 13.0, want 13.5" in wrong.detail
    none = preflight.check_jit({}, include_dir=str(tmp_path), which=lambda _: None)
    assert none.status == "FAIL"
    assert none.detail == f"CUDA_HOME is not set; no C++ compiler (c++/g++); no {tmp_path}/Python.h"
    assert "/opt/cuda" in none.fix


def test_presets_name_their_nixl_backends() -> None:
    assert preflight.preset_nixl_backends(CONFIGS / "prefill" / "vllm.yaml") == ["LIBFABRIC"]
    assert preflight.preset_nixl_backends(CONFIGS / "decode" / "vllm.yaml") == ["LIBFABRIC"]
    assert preflight.preset_nixl_backends(CONFIGS / "aggregated" / "vllm.yaml") == []


def test_a_backend_that_does_not_instantiate_is_refused_with_the_plugin_named() -> None:
    answer = {"LIBFABRIC": "nixlNotFoundError: NIXL_ERR_NOT_FOUND"}
    check = preflight.check_nixl(["LIBFABRIC"], lambda names: (answer, ""))
    assert check.status == "FAIL" and check.detail == "LIBFABRIC: nixlNotFoundError: NIXL_ERR_NOT_FOUND"
    assert "libfabric 2.1.0 (/opt/libfabric/lib" in check.fix and "backends: [UCX]" in check.fix
    every = lambda names: ({n: "ok" for n in names}, "")  # noqa: E731
    ok = preflight.check_nixl(["LIBFABRIC", "UCX"], every, devices=["uverbs0", "eth0"])
    assert ok.status == "PASS" and ok.detail == "LIBFABRIC, UCX instantiated"
    assert preflight.check_nixl([], lambda names: pytest.fail("no probe without NIXL")).status == "PASS"


def test_libfabric_on_a_gpu_node_needs_an_rdma_device_and_a_bare_container_only_warns() -> None:
    """On a GPU node without the EFA devices libfabric would fall back to TCP over the pod network:
    refused. A container with no GPU and no fabric at all (CI, --network=none; measured in the image:
    the plugin loads, its tcp rail cannot listen on lo, NIXL_ERR_BACKEND) is a warning."""
    every = lambda names: ({n: "ok" for n in names}, "")  # noqa: E731
    tcp_only = preflight.check_nixl(["LIBFABRIC"], every, devices=["eth0"], gpu_visible=True)
    assert tcp_only.status == "FAIL" and "no RDMA device (/dev/infiniband/uverbs*)" in tcp_only.detail
    assert "--device /dev/infiniband/uverbs" in tcp_only.fix
    assert preflight.check_nixl(["LIBFABRIC"], every, devices=["eth0"], gpu_visible=False).status == "PASS"
    assert preflight.check_nixl(["UCX"], every, devices=["eth0"], gpu_visible=True).status == "PASS"
    backend = lambda names: ({"LIBFABRIC": "nixlBackendError: NIXL_ERR_BACKEND"}, "")  # noqa: E731
    bare = preflight.check_nixl(["LIBFABRIC"], backend, devices=[], gpu_visible=False)
    assert bare.status == "WARN" and "found no fabric to open a rail on" in bare.detail
    assert preflight.check_nixl(["LIBFABRIC"], backend, devices=[], gpu_visible=True).status == "FAIL"
    assert preflight.check_nixl(["LIBFABRIC"], backend, devices=["eth0"], gpu_visible=False).status == "FAIL"


STORE_PIN = {"status": "missing", "artifact_store": "https://store.invalid/artifactory/"}


def _no_probe(url: str):
    pytest.fail(f"the store {url} was probed without {preflight.DOWNLOAD_ENV}=1")


@pytest.mark.parametrize("role", ["prefill", "decode", "aggregated"])
def test_without_an_artifact_set_a_role_fails_unless_the_download_is_accepted(role: str) -> None:
    check = preflight.check_flashinfer_artifacts(role, {}, aot=STORE_PIN, probe=_no_probe)
    assert check.status == "FAIL"
    assert check.detail.startswith("development image: needs FlashInfer's artifact store at first use: "
                                   "FLASHINFER_CUBIN_DIR is unset")
    assert "after the weights loaded; a node without access to its store fails there" in check.detail
    assert "`make image RELEASE=1`" in check.fix and "GLM53_FLASHINFER_DOWNLOAD=1" in check.fix
    assert "VLLM_HAS_FLASHINFER_CUBIN=1" in check.fix
    assert preflight.check_flashinfer_artifacts(role, {preflight.DOWNLOAD_ENV: "yes"}, aot=STORE_PIN,
                                                probe=_no_probe).status == "FAIL"   # only 1 accepts it


def test_an_accepted_download_needs_the_store_to_answer(tmp_path: Path) -> None:
    """The probe is real: a local HTTP server stands for FlashInfer's store, a closed port for a
    store the node cannot reach."""
    accept = {preflight.DOWNLOAD_ENV: "1"}
    with http_mirror(tmp_path) as url:
        named = preflight.check_flashinfer_artifacts("prefill", {**accept, "FLASHINFER_CUBINS_REPOSITORY": url}, aot={})
        pinned = preflight.check_flashinfer_artifacts("decode", accept, aot={"artifact_store": url})
        assert preflight.probe_store(url + "no-such-folder/") == (False, "HTTP 404 File not found")
    assert named.status == "WARN" and f"FlashInfer's store {url} answered (HTTP 200 in " in named.detail
    assert named.detail.startswith("development image: needs FlashInfer's artifact store at first use")
    assert "the prefill engine downloads there at first use" in named.detail
    assert pinned.status == "WARN" and f"store {url} answered" in pinned.detail   # the image's status file names it
    closed = closed_port_url()
    refused = preflight.check_flashinfer_artifacts("decode", {**accept, "FLASHINFER_CUBINS_REPOSITORY": closed},
                                                   aot=STORE_PIN)
    assert refused.status == "FAIL" and f"FlashInfer's store {closed} did not answer: " in refused.detail
    assert "refused" in refused.detail.lower()
    nowhere = preflight.check_flashinfer_artifacts("decode", accept, aot={})
    assert nowhere.status == "FAIL" and "no store to check" in nowhere.detail


def test_the_store_probe_gives_up_at_its_bound() -> None:
    """A store that takes the connection and never answers: the probe ends at its bound (5 s in
    the preflight; 0.5 s here), saying so."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)        # the kernel completes the handshake; nothing ever answers
        started = time.monotonic()
        answered, how = preflight.probe_store(f"http://127.0.0.1:{server.getsockname()[1]}/", timeout=0.5)
        took = time.monotonic() - started
    assert not answered and ("timed out" in how or "no answer within" in how), how
    assert took < 1.5
    assert preflight.PROBE_TIMEOUT_S == 5.0


def test_a_mounted_or_baked_set_is_checked_against_the_images_pins(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    pins = fa.read_pins(store.tree)
    cubins = tmp_path / "cubins"
    fa.fetch_set(pins, fa.Mirror(str(store.folder)), cubins, log=lambda _: None)
    aot = {"artifacts": {a.key: {"path": a.path, "manifest_sha256": a.manifest_sha256} for a in pins.artifacts}}
    env = {"FLASHINFER_CUBIN_DIR": str(cubins)}
    quiet = preflight.check_flashinfer_artifacts("prefill", env, aot=aot, probe=_no_probe)
    assert quiet.status == "WARN" and "but VLLM_HAS_FLASHINFER_CUBIN is not 1" in quiet.detail
    assert quiet.fix == "set VLLM_HAS_FLASHINFER_CUBIN=1 beside FLASHINFER_CUBIN_DIR"
    told = preflight.check_flashinfer_artifacts("prefill", {**env, "VLLM_HAS_FLASHINFER_CUBIN": "1"}, aot=aot)
    assert told.status == "PASS" and told.detail.startswith("2 artifact(s) (TRTLLM_GEN_BMM, TRTLLM_GEN_FMHA)")
    gone = preflight.check_flashinfer_artifacts("decode", {"FLASHINFER_CUBIN_DIR": str(tmp_path / "x")}, aot=aot)
    assert gone.status == "FAIL" and f"{tmp_path / 'x' / fa.RECORD}: missing" in gone.detail


# `fi_info -p efa` in libfabric's short format (util/info.c: provider, fabric, domain, version,
# type, protocol per entry; the efa provider names a domain <device>-rdm or -dgrm, libfabric 2.x
# lists the rdm one under its efa-direct fabric too). Written for these tests: the real tool
# needs EFA hardware, which no test machine has.
def fi_info_entry(device: str, fabric: str, kind: str) -> str:
    return (f"provider: efa\n    fabric: {fabric}\n    domain: {device}-{kind}\n    version: 201.0\n"
            f"    type: FI_EP_{'RDM' if kind == 'rdm' else 'DGRAM'}\n    protocol: FI_PROTO_EFA\n")


def fi_info_output(devices: list[str]) -> str:
    return "".join(fi_info_entry(d, fabric, kind) for d in devices
                   for fabric, kind in (("efa-direct", "rdm"), ("efa", "rdm"), ("efa", "dgrm")))


NO_EFA = "fi_getinfo: -61 (No data available)\n"


def stub_fi_info(folder: Path, stdout: str, stderr: str = "", code: int = 0) -> Path:
    """A stand-in ``fi_info`` on PATH (the real one needs EFA hardware): prints a recorded answer
    to ``fi_info -p efa`` and refuses any other arguments."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fi_info.out").write_text(stdout)
    (folder / "fi_info.err").write_text(stderr)
    script = folder / "fi_info"
    script.write_text('#!/bin/sh\n[ "$*" = "-p efa" ] || { echo "stub fi_info: unexpected $*" >&2; exit 2; }\n'
                      'here="$(dirname "$0")"\ncat "$here/fi_info.out"\ncat "$here/fi_info.err" >&2\n'
                      f"exit {code}\n")
    script.chmod(0o755)
    return folder


def uverbs(tmp_path: Path, count: int) -> Path:
    folder = tmp_path / "infiniband"
    folder.mkdir()
    for n in range(count):
        (folder / f"uverbs{n}").touch()
    return folder


def test_efa_provider_enumerates_every_device_the_pod_was_given(tmp_path: Path, monkeypatch) -> None:
    two = ["rdmap79s0", "rdmap80s0"]
    monkeypatch.setenv("PATH", f"{stub_fi_info(tmp_path / 'bin', fi_info_output(two))}:{os.environ['PATH']}")
    assert preflight.run_fi_info() == (0, fi_info_output(two))
    assert preflight.efa_devices(fi_info_output(two)) == two
    check = preflight.check_efa(["LIBFABRIC"], {}, infiniband=uverbs(tmp_path, 2))
    assert check.status == "PASS", check.detail
    assert check.detail == (f"fi_info -p efa enumerates 2 EFA device(s) (rdmap79s0, rdmap80s0) for the 2 asked for "
                            f"(2 {tmp_path / 'infiniband'}/uverbs* device(s) in the container)")
    wanted = preflight.check_efa(["LIBFABRIC"], {preflight.EFA_DEVICES_ENV: "16"}, infiniband=tmp_path / "none")
    assert wanted.status == "FAIL"
    assert wanted.detail.startswith("fi_info -p efa enumerates 2 EFA device(s) (rdmap79s0, rdmap80s0), fewer than "
                                    "the 16 asked for (GLM53_EFA_DEVICES=16): libfabric would use only those")
    assert "fi_info -p efa" in wanted.fix and "ibv_devices" in wanted.fix


def test_efa_devices_that_libfabric_cannot_open_fail_the_preflight(tmp_path: Path) -> None:
    """uverbs devices in the container, none enumerated by the efa provider (the case of a libefa
    that does not drive the device): libfabric would fall back to TCP without an error."""
    stub = stub_fi_info(tmp_path / "bin", "", NO_EFA, code=1)
    check = preflight.check_efa(["LIBFABRIC"], {}, fi_info=lambda: preflight.run_fi_info(str(stub / "fi_info")),
                                infiniband=uverbs(tmp_path, 16))
    assert check.status == "FAIL"
    assert check.detail.startswith("fi_info -p efa enumerates 0 EFA device(s) (fi_getinfo: -61 (No data available)), "
                                   "fewer than the 16 asked for")
    tcp = "provider: tcp\n    fabric: 10.0.0.0/16\n    domain: eth0\n    version: 201.0\n"
    assert preflight.efa_devices(tcp + fi_info_output(["rdmap1s0"])) == ["rdmap1s0"]   # other providers ignored


def test_efa_check_needs_libfabric_a_count_and_fi_info(tmp_path: Path) -> None:
    never = lambda: pytest.fail("fi_info run without a reason")  # noqa: E731
    assert preflight.check_efa(["UCX"], {}, fi_info=never).status == "PASS"
    bad = preflight.check_efa(["LIBFABRIC"], {preflight.EFA_DEVICES_ENV: "sixteen"}, fi_info=never)
    assert bad.status == "FAIL" and bad.detail == "GLM53_EFA_DEVICES='sixteen' is not a device count"
    nothing = tmp_path / "none"
    on_gpu = preflight.check_efa(["LIBFABRIC"], {}, fi_info=never, infiniband=nothing, gpu_visible=True)
    assert on_gpu.status == "FAIL" and "no EFA device asked for" in on_gpu.detail and "over TCP" in on_gpu.detail
    assert preflight.check_efa(["LIBFABRIC"], {}, fi_info=never, infiniband=nothing, gpu_visible=False).status == "WARN"
    code, why = preflight.run_fi_info(str(tmp_path / "no-fi_info"))
    assert code == 127 and "not found on PATH" in why


B300 = ("+---------------------------------------------------------------------------------------+\n"
        "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: 13.0                  |\n"
        "\nNVIDIA B300 SXM6 AC, 10.3, 580.95.05\nNVIDIA B300 SXM6 AC, 10.3, 580.95.05\n")


def test_gpu_checks_on_nvidia_smi_output() -> None:
    assert preflight.check_gpu(B300).status == "PASS"
    assert "2 x NVIDIA B300 SXM6 AC (10.3)" in preflight.check_gpu(B300).detail
    h200 = B300.replace("NVIDIA B300 SXM6 AC, 10.3", "NVIDIA H200, 9.0")
    check = preflight.check_gpu(h200)
    assert (check.status == "FAIL"
            and "NVIDIA H200 (compute capability 9.0): this image's kernels are sm_103a" in check.detail)
    old = B300.replace("CUDA Version: 13.0", "CUDA Version: 12.8").replace("580.95.05", "570.86.15")
    assert "driver 570.86.15 supports CUDA 12.8" in preflight.check_gpu(old).detail
    none = preflight.check_gpu(None)
    assert none.status == "WARN" and "GPU checks skipped" in none.detail


@pytest.mark.gpu
def test_gpu_check_on_this_node() -> None:
    smi = preflight.nvidia_smi()
    assert smi is not None, "no GPU visible"
    assert preflight.check_gpu(smi).status == "PASS"


def test_the_served_model_passes(tmp_path: Path) -> None:
    check = preflight.check_model(str(model_dir(tmp_path, GLM5_FP8)))
    assert check.status == "PASS"
    assert check.detail.startswith("GlmMoeDsaForCausalLM (MLA with DeepSeek-V3.2's sparse indexer")
    assert "top-8 of 256 experts, 2048 wide" in check.detail


GLM53_FLASH = {"architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next_text",
               "quantization_config": {"quant_method": "fp8"}}


@pytest.mark.parametrize("config, reason", [
    (GLM53_FLASH, "Glm5NextForCausalLM is GLM-5.3-Flash, vLLM 0.31.0's vllm/models/glm5next: a hybrid "
                  "linear-attention (KDA) model (IsHybrid) that needs the hybrid KV cache manager"),
    ({**GLM5_FP8, "architectures": ["DeepseekV3ForCausalLM"]},
     "architectures ['DeepseekV3ForCausalLM']: the presets serve GlmMoeDsaForCausalLM only"),
    ({k: v for k, v in GLM5_FP8.items() if k != "quantization_config"},
     "quantization_config.quant_method is None: the presets serve the FP8 checkpoint"),
    ({k: v for k, v in GLM5_FP8.items() if k != "index_topk"},
     "no index_topk: not a sparse-indexer model"),
    ({**GLM5_FP8, "qk_nope_head_dim": 64}, "qk_nope_head_dim=64: FLASHINFER_MLA_SPARSE needs 128 or 192"),
])
def test_a_model_the_presets_cannot_serve_is_refused_naming_why(tmp_path: Path, config: dict, reason: str) -> None:
    check = preflight.check_model(str(model_dir(tmp_path, config)))
    assert check.status == "FAIL"
    assert reason in check.detail
    assert "vllm serve" in check.fix


def test_a_missing_or_broken_config_json(tmp_path: Path) -> None:
    missing = preflight.check_model(str(model_dir(tmp_path, None)))
    assert missing.status == "FAIL" and missing.detail.endswith("config.json missing")
    broken = model_dir(tmp_path, None, "broken")
    (broken / "config.json").write_text("{not json")
    assert preflight.check_model(str(broken)).status == "FAIL"
    assert preflight.check_model("zai-org/GLM-5.3-FP8").status == "WARN"   # a hub id: vLLM downloads it


def _probe_ok(names):
    return {n: "ok" for n in names}, ""


def test_run_checks_and_render_in_seconds(tmp_path: Path, tmpfs) -> None:
    env = {"CUDA_HOME": str(_image_cuda_home(tmp_path)), "TMPDIR": str(tmp_path), "HOME": str(tmp_path),
           preflight.EFA_DEVICES_ENV: "2"}
    model = str(model_dir(tmp_path, GLM5_FP8))
    checks = preflight.run_checks("prefill", model, env, config_root=CONFIGS, shm=tmpfs("64m"),
                                  cache=tmp_path / "cache", probe=_probe_ok, smi=lambda: None,
                                  fi_info=lambda: (0, fi_info_output(["rdmap79s0", "rdmap80s0"])), aot=STORE_PIN,
                                  store_probe=_no_probe)
    by = {c.name: c.status for c in checks}
    memlock = preflight.check_memlock(preflight.preset_nixl_backends(CONFIGS / "prefill" / "vllm.yaml")).status
    assert by == {"shm": "FAIL", "cache": "PASS", "tmp and home": "PASS", "jit toolchain": "PASS",
                  "nixl backends": "PASS",
                  "efa devices": "PASS", "memlock": memlock, "flashinfer artifacts": "FAIL", "gpu": "WARN",
                  "model": "PASS"}
    text = preflight.render(checks, 1.2)
    assert "preflight: FAIL  shm" in text and "fix: run the container with --ipc=host" in text
    assert "preflight: FAIL  flashinfer artifacts  development image: needs FlashInfer's artifact store" in text
    fails, warns = (sum(v == s for v in by.values()) for s in ("FAIL", "WARN"))
    assert text.rstrip().splitlines()[-1].startswith(f"preflight: FAILED in 1.2 s ({fails} fail, {warns} warn)")


def test_entrypoint_runs_the_preflight_before_a_role_and_can_skip_it() -> None:
    chosen = entrypoint.plan(["prefill", "/models/GLM-5.3-FP8", "--port", "8100"], {}, config_root=CONFIGS)
    assert chosen.preflight == ("prefill", "/models/GLM-5.3-FP8")
    skipped = entrypoint.plan(["decode", "/m", "--skip-preflight", "--port", "1"], {}, config_root=CONFIGS)
    assert skipped.preflight is None and skipped.argv[-2:] == ["--port", "1"] and "--skip-preflight" not in skipped.argv
    assert entrypoint.plan(["decode", "/m"], {"GLM53_SKIP_PREFLIGHT": "1"}, config_root=CONFIGS).preflight is None
    assert entrypoint.plan(["vllm", "serve", "/m"], {}).preflight is None   # the upstream form: no preset, no preflight
    assert entrypoint.plan(["preflight", "prefill", "/m"], {}).argv[1:] == ["-m", "imagectl.preflight", "prefill", "/m"]


def test_entrypoint_refuses_to_start_when_the_preflight_fails(tmp_path: Path) -> None:
    """The real entrypoint script: a model the presets cannot serve stops it before vLLM."""
    model = model_dir(tmp_path, GLM53_FLASH)
    env = {**os.environ, "GLM53_CONFIGS": str(CONFIGS), "PYTHONPATH": str(REPO / "image")}
    done = subprocess.run([sys.executable, str(REPO / "image" / "entrypoint"), "prefill", str(model)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    assert "preflight: FAIL  model" in done.stderr and "Glm5NextForCausalLM is GLM-5.3-Flash" in done.stderr
    assert "the preflight failed; prefill not started" in done.stderr
    assert "exec vllm" not in done.stderr


def test_identity_for_a_uid_without_a_passwd_entry(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()

    def unknown(uid):
        raise KeyError(uid)

    got = identity.identity_env({"HOME": "/"}, uid=1000680000, lookup=unknown, homes=(tmp_path / "no", home))
    assert got == {"USER": "uid1000680000", "LOGNAME": "uid1000680000", "HOME": str(home)}
    assert identity.identity_env({"HOME": str(home), "USER": "me"}, uid=1000680000, lookup=unknown) == \
        {"LOGNAME": "uid1000680000"}
    assert identity.identity_env({"HOME": str(home)}, uid=os.getuid()) == {}   # a known UID keeps its own


def test_getuser_works_for_an_unknown_uid_with_the_identity_env(tmp_path: Path) -> None:
    """getpass.getuser() (torch's inductor cache dir) raises for a UID not in /etc/passwd unless
    USER/LOGNAME is set: run it as such a UID (root here can setuid) with and without."""
    if os.getuid() != 0:
        pytest.fail("needs root to run a process as a UID without a passwd entry", pytrace=False)
    # Imports first: this interpreter's files are not readable once it is that UID.
    code = ("import os, getpass, sys; sys.path.insert(0, sys.argv[1]); from imagectl import identity;"
            "os.setgid(0); os.setuid(1000680000); os.environ.update(identity.identity_env(dict(os.environ)));"
            "print(getpass.getuser(), os.environ['HOME'])")
    env = {k: v for k, v in os.environ.items() if k not in ("USER", "LOGNAME", "LNAME", "USERNAME")}
    env["HOME"] = "/"
    done = subprocess.run([sys.executable, "-c", code, str(REPO / "image")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    user, home = done.stdout.split()
    assert user == "uid1000680000" and home == "/tmp"   # no /home/serve here; /tmp is writable
    bare = subprocess.run([sys.executable, "-c", "import os, getpass; os.setuid(1000680000); getpass.getuser()"],
                          capture_output=True, text=True, env=env)
    assert bare.returncode != 0 and "getpwuid" in bare.stderr   # what the fallback prevents


def test_dockerfile_gives_caches_and_home_to_group_0() -> None:
    text = (REPO / "Dockerfile").read_text()
    runtime = text[text.index("FROM base AS runtime"):]
    assert "useradd --create-home --uid 1000 --gid 0" in runtime
    assert "chown -R 1000:0 /cache /home/serve" in runtime and "chmod -R g+rwX /cache /home/serve" in runtime
    assert "\nUSER 1000:0\n" in runtime


def test_memlock_is_required_for_the_nixl_roles() -> None:
    """The image runs as uid 1000 (no CAP_IPC_LOCK effective): RDMA registration then needs an
    unlimited RLIMIT_MEMLOCK; root with CAP_IPC_LOCK passes whatever the limit."""
    import resource

    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    docker_default = (8 << 20, 8 << 20)
    cap_ipc_lock = 1 << preflight.CAP_IPC_LOCK
    refused = preflight.check_memlock(["UCX"], docker_default, capabilities=0)
    assert refused.status == "FAIL" and "RLIMIT_MEMLOCK 8 MiB and no CAP_IPC_LOCK" in refused.detail
    assert "UCX" in refused.detail and "--ulimit memlock=-1:-1" in refused.fix
    assert preflight.check_memlock(["LIBFABRIC"], unlimited, capabilities=0).status == "PASS"
    assert preflight.check_memlock(["UCX"], docker_default, capabilities=cap_ipc_lock).status == "PASS"
    assert preflight.check_memlock([], docker_default, capabilities=0).status == "WARN"


def test_effective_capabilities_are_read_from_proc(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t0000000000004000\n")
    assert preflight.effective_capabilities(status) == 1 << preflight.CAP_IPC_LOCK
    assert preflight.effective_capabilities() >= 0   # this process's own, readable
