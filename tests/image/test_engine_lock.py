"""Engine detection and configuration; the lock writer's checks."""
from __future__ import annotations

from pathlib import Path

import pytest

from distbuild.host import engine, lock
from distbuild.errors import DistBuildError
from distbuild.pins import Pin, load as load_pins

REPO = Path(__file__).resolve().parents[2]


def test_first_answering_engine_wins_and_a_dead_docker_does_not_count() -> None:
    which = {"docker": "/usr/bin/docker", "podman": "/usr/bin/podman", "buildah": "/usr/bin/buildah"}.get
    alive = {"/usr/bin/podman", "/usr/bin/buildah"}
    found = engine.find_engine(probe=lambda cmd: cmd[0] in alive, which=which)
    assert found == engine.Engine("podman", "/usr/bin/podman")
    assert engine.find_engine(probe=lambda cmd: False, which=which) is None
    assert engine.find_engine("buildah", probe=lambda cmd: cmd[0] in alive, which=which).name == "buildah"
    with pytest.raises(DistBuildError, match="expected docker, podman or buildah"):
        engine.find_engine("kaniko")


def test_build_command_per_engine() -> None:
    args = {"BASE_IMAGE": "abc"}
    podman = engine.Engine("podman", "podman").build_cmd(Path("/r"), Path("/r/Dockerfile"), "sources", "t", args,
                                                         {"build-ca": Path("/ca.crt")})
    assert podman[:2] == ["podman", "build"] and "--format=docker" in podman and "--layers" in podman
    assert "--build-arg=BASE_IMAGE=abc" in podman and "--secret=id=build-ca,src=/ca.crt" in podman
    assert podman[-1] == "/r" and podman[podman.index("--target") + 1] == "sources"
    assert (engine.Engine("buildah", "buildah").build_cmd(Path("/r"), Path("/r/D"), "x", "t", {})[:2]
            == ["buildah", "bud"])
    assert "--format=docker" not in engine.Engine("docker", "docker").build_cmd(Path("/r"), Path("/r/D"), "x", "t", {})


def test_containers_conf_written_once_and_never_over_an_admins(tmp_path: Path) -> None:
    conf = tmp_path / "containers.conf"
    assert engine.write_containers_conf(conf, log=lambda _: None)
    text = conf.read_text()
    assert 'runtime = "runc"' in text and '"nofile=1024:1024"' in text and '"nproc=4096:4096"' in text
    assert not engine.write_containers_conf(conf, log=lambda _: None)
    conf.write_text("[engine]\nruntime = \"crun\"\n")
    said: list[str] = []
    assert not engine.write_containers_conf(conf, log=said.append)
    assert "keeping the existing" in said[0] and conf.read_text().startswith("[engine]")


def test_is_debian(tmp_path: Path) -> None:
    release = tmp_path / "os-release"
    release.write_text('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\n')
    assert engine.is_debian(release)
    release.write_text("ID=ubuntu\nID_LIKE=debian\n")
    assert engine.is_debian(release)
    release.write_text("ID=fedora\n")
    assert not engine.is_debian(release)


def _pin(name: str, filename: str, sha: str) -> Pin:
    return Pin(name, "1.0", "wheel", "image", filename, sha, 1)


def test_lock_refuses_a_closure_that_disagrees_with_the_pins() -> None:
    locked = [lock.Locked("torch", "1.0", "torch-1.0-cp311-cp311-manylinux_2_28_x86_64.whl", "a" * 64)]
    lock.check_against_pins(locked, [_pin("torch", "torch-1.0-cp311-cp311-manylinux_2_28_x86_64.whl", "a" * 64)])
    with pytest.raises(DistBuildError, match="pins.toml pins .* the index resolved"):
        lock.check_against_pins(locked, [_pin("torch", "torch-1.0-cp311-cp311-manylinux_2_28_x86_64.whl", "b" * 64)])
    with pytest.raises(DistBuildError, match="not in the resolved closure"):
        lock.check_against_pins(locked, [_pin("vllm", "vllm-1.0-cp38-abi3-manylinux_2_28_x86_64.whl", "c" * 64)])


def test_lock_rendering_leaves_out_the_patched_projects() -> None:
    locked = [lock.Locked("lmcache", "0.5.5", "lmcache.whl", "a" * 64),
              lock.Locked("torch", "2.13.0", "t.whl", "b" * 64)]
    text = lock.render(locked, "title", ("lmcache",))
    assert "lmcache==" not in text and "left out (installed from our patched builds): lmcache" in text
    assert "torch==2.13.0 \\\n    --hash=sha256:" + "b" * 64 in text


def test_the_operator_tools_requirements_are_in_the_image_lock() -> None:
    """scripts/requirements.txt goes into the image's closure (make lock resolves it with the
    rest): every tool requirement is in build/lock/image.txt at its pinned version."""
    tools = lock.requirement_lines(REPO / "scripts" / "requirements.txt")
    assert tools and all("==" in t for t in tools)
    locked = {}
    for line in (REPO / "build" / "lock" / "image.txt").read_text().splitlines():
        if "==" in line and not line.startswith(("#", " ")):
            name, version = line.split(" ")[0].split("==")
            locked[name] = version
    for requirement in tools:
        name, version = requirement.split("==")
        assert locked.get(name.lower().replace("_", "-")) == version, f"{requirement} is not in build/lock/image.txt"
    pins = [_pin("torch", "torch-1.0-cp311-cp311-manylinux_2_28_x86_64.whl", "a" * 64),
            Pin("lmcache", "0.5.5", "sdist", "upstream", "lmcache-0.5.5.tar.gz", "b" * 64, 1, upstream="lmcache"),
            Pin("flashinfer-python", "0.7.0.post1", "sdist", "upstream", "f.tar.gz", "c" * 64, 1,
                upstream="flashinfer"), *TOOLCHAIN]
    assert lock.image_specs(pins, tools)[-len(tools):] == tools


TOOLCHAIN = [p for p in load_pins(REPO / "build" / "pins.toml") if p.role == "toolchain"]


def _locked_lines(name: str) -> dict[str, tuple[str, str]]:
    from imagectl.locks import entries_from_lock
    return entries_from_lock((REPO / "build" / "lock" / name).read_text())


def test_the_image_closure_carries_the_toolchains_compiler_and_no_other() -> None:
    """vLLM 0.31.0 requires humming-kernels[cu13], whose extra asks for nvidia-cuda-nvcc and
    nvidia-cuda-cccl unversioned: pip alone took nvcc/crt/nvvm 13.5.37 and CCCL 13.3. The lock
    requires the toolchain's wheels instead, at the pins' files and hashes."""
    locked = _locked_lines("image.txt")
    by_name = {p.name: p for p in TOOLCHAIN}
    for name in lock.JIT_TOOLCHAIN:
        assert locked[name] == (by_name[name].version, by_name[name].sha256), name
    assert locked["nvidia-cuda-nvcc"][0] == "13.0.88"
    specs = lock.image_specs([*TOOLCHAIN,
                              *[p for p in load_pins(REPO / "build" / "pins.toml") if p.role != "toolchain"]])
    assert "nvidia-cuda-nvcc==13.0.88" in specs and "nvidia-cuda-cccl==13.0.85" in specs
    assert not any(s.startswith("nvidia-cuda-runtime") for s in specs)   # torch's cuda-toolkit pins the runtime's


def test_lock_refuses_a_second_cuda_compiler() -> None:
    nvcc = next(p for p in TOOLCHAIN if p.name == "nvidia-cuda-nvcc")
    newer = lock.Locked("nvidia-cuda-nvcc", "13.5.37", "nvidia_cuda_nvcc-13.5.37-py3-none-manylinux2014_x86_64.whl",
                        "d" * 64)
    with pytest.raises(DistBuildError, match=f"nvidia-cuda-nvcc: pins.toml pins {nvcc.filename} sha256 {nvcc.sha256}, "
                                             "the index resolved nvidia_cuda_nvcc-13.5.37"):
        lock.check_against_pins([newer], [nvcc])
    with pytest.raises(DistBuildError, match="no toolchain pin for nvidia-cuda-nvcc"):
        lock.jit_toolchain_pins([p for p in TOOLCHAIN if p.name != "nvidia-cuda-nvcc"])


def test_requirement_lines_and_a_missing_file(tmp_path: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("# tools\naiohttp==3.14.5\n\nvalkey==6.2.0  # the sampler\n")
    assert lock.requirement_lines(req) == ["aiohttp==3.14.5", "valkey==6.2.0"]
    with pytest.raises(DistBuildError, match="nope.txt: cannot read the requirements"):
        lock.requirement_lines(tmp_path / "nope.txt")
