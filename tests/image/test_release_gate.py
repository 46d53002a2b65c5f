"""Release gating of the image on FlashInfer's artifact set, end to end without the network.

The store cannot be reached from a build or test machine, so a synthetic mirror folder stands
for it: a FlashInfer-shaped tree whose ``flashinfer/artifacts.py`` pins the sha256 of each
artifact's ``checksums.txt``, which lists the sha256 of every file (FlashInfer's own chain,
``make_store``). Along that chain a set is fetched, a wrong hash is refused naming the file,
the set is staged by the function ``make image`` stages with, verified and copied by the
``flashinfer-wheel`` stage's own code into a folder standing for the image's tree, and found
complete there by the preflight and the self-test. ``make image RELEASE=1`` stops, naming what
is missing, before any stage is built.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from distbuild import cli

from distbuild.host import image
from distbuild import flashinfer_artifacts as fa
from distbuild.errors import DistBuildError
from distbuild.paths import Layout
from imagectl import flashinfer_aot, labels, preflight, selftest

from .conftest import REPO
from .test_flashinfer_artifacts import BMM, FMHA, Store, make_store, sha

IMAGE_CUBINS = "opt/flashinfer/cubins"   # flashinfer_aot.IMAGE_CUBIN_DIR, under the stand-in image root


class FakeSpec:
    """A FlashInfer JitSpec whose build writes a small library instead of running nvcc."""

    def __init__(self, folder: Path, name: str) -> None:
        self.path = folder / f"{name}.so"

    def build(self, verbose: bool = False) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(b"\x7fELF " + self.path.name.encode())

    def get_library_path(self) -> Path:
        return self.path


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch) -> None:
    """The download cache is the test's work/ folder: a shared one may hold a real set."""
    monkeypatch.delenv("DIST_CACHE_DIR", raising=False)
    monkeypatch.delenv("FLASHINFER_CUBINS_REPOSITORY", raising=False)


def _repo(tmp_path: Path) -> Layout:
    """A repository holding what check_inputs reads, and an empty staging folder."""
    repo = tmp_path / "repo"
    (repo / "build" / fa.CACHE_SUBDIR).mkdir(parents=True)
    shutil.copy(REPO / "Dockerfile", repo / "Dockerfile")
    shutil.copy(REPO / "build" / "pins.toml", repo / "build" / "pins.toml")
    shutil.copytree(REPO / "build" / "lock", repo / "build" / "lock")
    return Layout(repo=repo, work=tmp_path / "work")


class NoEngine:
    """Any use means the build went past the release gate."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the build reached the container engine ({name})")


def test_release_without_a_set_stops_before_any_stage_naming_what_is_missing(tmp_path: Path) -> None:
    layout = _repo(tmp_path)
    lines: list[str] = []
    with pytest.raises(DistBuildError) as err:
        image.run(layout, image.Options(release=True), log=lines.append, engine=NoEngine())  # type: ignore[arg-type]
    message = str(err.value)
    assert message.startswith(f"RELEASE=1: no complete FlashInfer artifact set in {layout.cache / fa.CACHE_SUBDIR}")
    assert f"{fa.RECORD} (no complete set: run `make flashinfer-artifacts`)" in message
    assert "make flashinfer-artifacts [FLASHINFER_MIRROR=url-or-folder]" in message
    assert any(labels.DEVELOPMENT in line for line in lines)
    assert not (layout.work / "image").exists()            # no stage log, no report: nothing was built
    # Without RELEASE the same build goes on, a development image (it stops here only at the
    # engine stand-in, past the staging step).
    with pytest.raises(AssertionError, match=r"the build reached the container engine \(name\)"):
        image.run(layout, image.Options(), log=lambda _: None, engine=NoEngine())  # type: ignore[arg-type]


def test_release_problems_name_the_pinned_manifests_or_the_pins_that_differ(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    pins = fa.read_pins(store.tree)
    absent = fa.release_problems(fa.set_status(tmp_path / "empty"), pins)
    pinned = {key: sha(store.manifests[path + "checksums.txt"])[:12] for key, path in (("BMM", BMM), ("FMHA", FMHA))}
    assert absent == [f"{BMM}checksums.txt (CheckSumHash.TRTLLM_GEN_BMM {pinned['BMM']}) and every file it lists",
                      f"{FMHA}checksums.txt (CheckSumHash.TRTLLM_GEN_FMHA {pinned['FMHA']}) and every file it lists"]
    cache = tmp_path / "cache"
    fa.fetch_set(pins, fa.Mirror(str(store.folder)), cache, log=lambda _: None)
    assert fa.release_problems(fa.set_status(cache), pins) == []
    (cache / FMHA / "fmhaSm100fKernel_QE4m3.cubin").unlink()
    assert fa.release_problems(fa.set_status(cache), pins) == [f"{FMHA}fmhaSm100fKernel_QE4m3.cubin"]
    bumped = fa.Pins(pins.store, (fa.Artifact("TRTLLM_GEN_BMM", "fedcba98/batched_gemm-next/", "e" * 64),
                                  pins.artifacts[1]))
    (cache / FMHA / "fmhaSm100fKernel_QE4m3.cubin").write_bytes(store.files[FMHA + "fmhaSm100fKernel_QE4m3.cubin"])
    problem, = fa.release_problems(fa.set_status(cache), bumped)
    assert problem.startswith(f"TRTLLM_GEN_BMM: the set holds {BMM}checksums.txt sha256 ")
    assert problem.endswith("the patched tree pins fedcba98/batched_gemm-next/checksums.txt sha256 eeeeeeeeeeee")


class SourcesStage:
    """The sources stage's image, as Builder.run reads files from it (``cat``)."""

    def __init__(self, tree: Path) -> None:
        self.tree = tree
        self.logged: list[str] = []

    def run(self, tag: str, argv: list[str], entrypoint: str | None = None) -> subprocess.CompletedProcess:
        assert entrypoint == "cat" and argv[0].startswith("/work/src/flashinfer/")
        path = self.tree / argv[0].removeprefix("/work/src/flashinfer/")
        if not path.is_file():
            return subprocess.CompletedProcess(argv, 1, "", f"cat: {argv[0]}: No such file or directory")
        return subprocess.CompletedProcess(argv, 0, path.read_text(), "")

    def log(self, line: str) -> None:
        self.logged.append(line)


def test_release_checks_the_staged_set_against_the_sources_stage_pins(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    cache = tmp_path / "cache"
    fa.fetch_set(fa.read_pins(store.tree), fa.Mirror(str(store.folder)), cache, log=lambda _: None)
    stage = SourcesStage(store.tree)
    image._check_release_pins(stage, "localhost/glm53-stage:sources", fa.set_status(cache))  # type: ignore[arg-type]
    assert "matches the patched tree's pins (TRTLLM_GEN_BMM, TRTLLM_GEN_FMHA)" in stage.logged[-1]
    artifacts_py = store.tree / "flashinfer" / "artifacts.py"       # the patched tree moved to new pins
    artifacts_py.write_text(artifacts_py.read_text().replace(FMHA, "89abcdef/fmha/trtllm-gen/"))
    with pytest.raises(DistBuildError, match=r"RELEASE=1: the staged FlashInfer artifact set does not match the "
                                             r"patched tree: TRTLLM_GEN_FMHA: the set holds 4567ef01/fmha/"):
        image._check_release_pins(stage, "localhost/glm53-stage:sources", fa.set_status(cache))  # type: ignore[arg-type]
    (store.tree / "flashinfer" / "jit" / "cubin_loader.py").unlink()
    with pytest.raises(DistBuildError, match=r"cannot read /work/src/flashinfer/flashinfer/jit/cubin_loader.py"):
        image._check_release_pins(stage, "localhost/glm53-stage:sources", fa.set_status(cache))  # type: ignore[arg-type]


def test_synthetic_mirror_to_the_images_tree_found_by_the_preflight(tmp_path: Path, monkeypatch, capsys) -> None:
    store: Store = make_store(tmp_path)
    pins = fa.read_pins(store.tree)
    layout = _repo(tmp_path)
    cache = layout.cache / fa.CACHE_SUBDIR
    # A wrong hash on the mirror is refused, naming the file, and leaves no set behind.
    good = store.files[BMM + "Bmm_E4m3_sm103a.cubin"]
    store.corrupt(BMM + "Bmm_E4m3_sm103a.cubin")
    with pytest.raises(DistBuildError,
                       match=rf"{BMM}Bmm_E4m3_sm103a.cubin from .*: sha256 mismatch: expected {sha(good)}"):
        fa.fetch_set(pins, fa.Mirror(str(store.folder)), cache, log=lambda _: None)
    assert not fa.set_status(cache).complete
    (store.folder / BMM / "Bmm_E4m3_sm103a.cubin").write_bytes(good)
    fa.fetch_set(pins, fa.Mirror(store.folder.as_uri()), cache, log=lambda _: None)

    # make image's staging step, then the flashinfer-wheel stage's verification and copy.
    staged = image._stage_flashinfer_artifacts(layout, image.Options(release=True), log=lambda _: None)
    assert staged.complete and fa.release_problems(staged, pins) == []
    monkeypatch.setattr(flashinfer_aot, "_gen", lambda module: lambda: FakeSpec(tmp_path / "jit", module.name))
    for name in ("FLASHINFER_CUBIN_DIR", "FLASHINFER_NO_DOWNLOAD"):   # build() sets both for its compiles
        monkeypatch.setenv(name, "")
    out = tmp_path / "out"
    assert flashinfer_aot.build(store.tree, layout.repo / "build" / fa.CACHE_SUBDIR, out,
                                out / "flashinfer-aot.json") == 0
    status = json.loads((out / "flashinfer-aot.json").read_text())
    assert status["status"] == "built" and status["cubin_dir"] == flashinfer_aot.IMAGE_CUBIN_DIR
    assert labels.build_args({"upstreams": {}}, status["status"])["IMAGE_KIND"] == labels.RELEASE

    # The runtime stage's COPY --from=flashinfer-wheel /out/cubins/ /opt/flashinfer/cubins/.
    root = tmp_path / "image-root"
    shutil.copytree(out / "cubins", root / IMAGE_CUBINS)
    env = {"FLASHINFER_CUBIN_DIR": str(root / IMAGE_CUBINS), "VLLM_HAS_FLASHINFER_CUBIN": "1"}
    for role in ("prefill", "decode", "aggregated"):
        check = preflight.check_flashinfer_artifacts(role, env, aot=status, probe=lambda url: pytest.fail("no probe"))
        assert check.status == "PASS", check.detail
    assert check.detail == (f"2 artifact(s) (TRTLLM_GEN_BMM, TRTLLM_GEN_FMHA), {len(store.files)} file(s) in "
                            f"{root / IMAGE_CUBINS}, VLLM_HAS_FLASHINFER_CUBIN=1")
    assert flashinfer_aot.check_cubin_dir(root / IMAGE_CUBINS, deep=True,
                                          pinned=flashinfer_aot.pinned_artifacts(status)) == []
    kind = selftest.check_artifact_set({**status, "cubin_dir": str(root / IMAGE_CUBINS)}, env)
    assert kind.status == "PASS" and kind.detail.startswith("release: 2 artifact(s)")

    # A file lost from the image's set, or a set fetched for other pins, fails the preflight.
    (root / IMAGE_CUBINS / BMM / "include/flashinferMetaInfo.h").unlink()
    lost = preflight.check_flashinfer_artifacts("decode", env, aot=status)
    assert lost.status == "FAIL" and f"{BMM}include/flashinferMetaInfo.h: missing" in lost.detail
    other = dict(status,
                 artifacts={"TRTLLM_GEN_BMM": {"path": "fedcba98/batched_gemm-next/", "manifest_sha256": "e" * 64}})
    shutil.rmtree(root / IMAGE_CUBINS)
    shutil.copytree(out / "cubins", root / IMAGE_CUBINS)
    refused = preflight.check_flashinfer_artifacts("prefill", env, aot=other)
    assert refused.status == "FAIL" and "holds no fedcba98/batched_gemm-next/checksums.txt" in refused.detail


def test_release_flag_from_make_and_the_cli() -> None:
    args = cli.parser().parse_args(["image", "--release"])
    assert image.Options.from_args(args).release is True
    assert image.Options.from_args(cli.parser().parse_args(["image", "--strict"])).release is True   # the old name
    assert image.Options.from_args(cli.parser().parse_args(["image"])).release is False
    for variables, flag in ((["RELEASE=1"], True), (["STRICT=1"], True), ([], False)):
        done = subprocess.run(["make", "-n", "-C", str(REPO), "image", *variables], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert (" --release" in done.stdout) is flag, done.stdout


def test_labels_and_env_say_what_the_image_is() -> None:
    manifest = {"upstreams": {}}
    assert labels.build_args(manifest, "missing")["IMAGE_KIND"] == \
        "development image: needs FlashInfer's artifact store at first use"
    assert labels.build_args(manifest, "built")["IMAGE_KIND"].startswith("release")
    assert labels.LABEL_OF_ARG["IMAGE_KIND"] == "io.glm53.image.kind"
    runtime = (REPO / "Dockerfile").read_text().split("FROM base AS runtime", 1)[1]
    assert "ARG VLLM_HAS_FLASHINFER_CUBIN=0" in runtime
    assert "VLLM_HAS_FLASHINFER_CUBIN=${VLLM_HAS_FLASHINFER_CUBIN}" in runtime
