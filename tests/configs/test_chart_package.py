"""`make chart`: the chart as a self-contained package (build/distbuild/host/chart.py): the folder and
the .tgz hold no symlink, the package renders exactly as the source chart, the engine configs in
it equal configs/prefill and configs/decode, and the same chart gives the same sha256."""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile

import pytest

from tests.configs.support import CONFIGS, REPO
from tests.deploy.cell import render, render_cell, sets


def make_chart(work):
    done = subprocess.run(["make", "--no-print-directory", "chart", f"WORK={work}", f"PYTHON={sys.executable}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "DIST_HELM": render.helm_binary()})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def packaged(tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    return work, make_chart(work)


def test_make_chart_prints_the_packages_sha256(packaged):
    work, out = packaged
    (tgz,) = (work / "chart").glob("glm53-cell-*.tgz")
    digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
    assert re.search(rf"^sha256: {digest}$", out, re.MULTILINE), out
    assert (work / "chart" / f"{tgz.name}.sha256").read_text() == f"{digest}  {tgz.name}\n"
    version = re.search(r"^version:\s*(\S+)", (render.CHART / "Chart.yaml").read_text(), re.MULTILINE)[1]
    assert tgz.name == f"glm53-cell-{version}.tgz"
    assert f"work/chart/glm53-cell-{version}.tgz" in (REPO / "docs" / "deploy.md").read_text()


def test_the_package_and_its_folder_hold_no_symlink(packaged):
    work, _ = packaged
    (tgz,) = (work / "chart").glob("*.tgz")
    with tarfile.open(tgz) as tar:
        members = tar.getmembers()
    assert members and not [m.name for m in members if m.issym() or m.islnk()]
    names = {m.name for m in members}
    for role, files in (("prefill", ("env", "vllm.yaml", "lmcache.yaml")), ("decode", ("env", "vllm.yaml"))):
        for name in files:
            assert f"glm53-cell/files/{role}/{name}" in names
    folder = work / "chart" / "glm53-cell"
    assert not [p for p in folder.rglob("*") if p.is_symlink()]
    # The source chart keeps its links (one copy of the engine configs in the repository).
    assert (render.CHART / "files" / "prefill").is_symlink()


def test_the_packaged_engine_configs_equal_their_sources(packaged):
    work, _ = packaged
    folder = work / "chart" / "glm53-cell" / "files"
    for role in ("prefill", "decode"):
        for source in sorted((CONFIGS / role).iterdir()):
            if source.is_file():
                assert (folder / role / source.name).read_bytes() == source.read_bytes(), source


def test_the_package_renders_as_the_source_chart(packaged):
    work, _ = packaged
    (tgz,) = (work / "chart").glob("*.tgz")
    assert render.render(sets(), chart=tgz) == render_cell()
    assert render.render(sets(), chart=work / "chart" / "glm53-cell") == render_cell()


def test_the_same_chart_gives_the_same_package(packaged, tmp_path):
    work, out = packaged
    again = make_chart(tmp_path)
    digest = re.search(r"^sha256: (\w+)$", out, re.MULTILINE)[1]
    assert re.search(r"^sha256: (\w+)$", again, re.MULTILINE)[1] == digest


def test_the_symlink_check_is_no_rubber_stamp(tmp_path):
    """The check make chart runs finds a link in a folder and in a package."""
    sys.path.insert(0, str(REPO / "build"))
    try:
        from distbuild.host import chart
    finally:
        sys.path.pop(0)
    folder = tmp_path / "c"
    (folder / "files").mkdir(parents=True)
    (folder / "Chart.yaml").write_text("name: c\nversion: 1.0.0\n")
    (folder / "files" / "prefill").symlink_to(CONFIGS / "prefill")
    assert chart.symlinks_in_folder(folder) == ["files/prefill"]
    tgz = tmp_path / "c.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(folder, arcname="c")
    assert chart.symlinks_in_package(tgz) == ["c/files/prefill"]
    assert chart.chart_version(folder) == ("c", "1.0.0")
