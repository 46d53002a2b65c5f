"""The nvcc output cache (nvcc_cache.py) with the pinned nvcc: a compile is reused only when
every input it reads is unchanged, wherever its files lie."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.flashinfer import activation_build as ab
from tests.flashinfer import nvcc_cache

KERNEL = """#include "scale.cuh"
__global__ void scale(float* x) { x[threadIdx.x] *= SCALE * FACTOR; }
"""


@pytest.fixture
def cuda():
    home = ab.cuda_home()
    if home is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("DIST_CUDA_HOME is not set (CI=true: the cache is checked with the real nvcc)", pytrace=False)
        pytest.skip("DIST_CUDA_HOME is not set to a CUDA toolkit with bin/nvcc")
    return home


@pytest.fixture
def store(tmp_path, monkeypatch):
    root = tmp_path / "store"
    monkeypatch.setenv(nvcc_cache.CACHE_ENV, str(root))
    return root


def _project(folder: Path, scale: str = "2.0f") -> Path:
    (folder / "include").mkdir(parents=True)
    (folder / "include" / "scale.cuh").write_text(f"#define SCALE {scale}\n")
    (folder / "kernel.cu").write_text(KERNEL)
    return folder


def _compile(cuda: Path, project: Path, out: Path, factor: str = "3.0f") -> str:
    out.mkdir(parents=True, exist_ok=True)
    keep = out / "keep"
    keep.mkdir(exist_ok=True)
    roots = [f"-I{project / 'include'}", f"-I{project / 'absent'}"]  # an absent root, as a bundle has
    return ab.nvcc(cuda, ["-gencode=arch=compute_90a,code=sm_90a", f"-DFACTOR={factor}", *roots, "-cubin",
                          "-Xptxas", "-v", "--keep", f"--keep-dir={keep}", "-o", str(out / "kernel.cubin"),
                          str(project / "kernel.cu")], out / "nvcc.log")


def _reused(out: Path) -> bool:
    return (out / "nvcc.log").read_text().split("\n\n", 1)[1].startswith(nvcc_cache.REUSED)


def test_an_identical_compile_elsewhere_reuses_the_outputs(cuda, store, tmp_path):
    first = _compile(cuda, _project(tmp_path / "a"), tmp_path / "out-a")
    assert not _reused(tmp_path / "out-a") and "Used" in first  # ptxas -v ran
    second = _compile(cuda, _project(tmp_path / "b"), tmp_path / "out-b")  # same bytes, another folder
    assert _reused(tmp_path / "out-b")
    assert second.endswith(first) and "Used" in second
    for rel in ("kernel.cubin", "keep/kernel.ptx"):
        assert (tmp_path / "out-a" / rel).read_bytes() == (tmp_path / "out-b" / rel).read_bytes(), rel


@pytest.mark.parametrize("change", ["header", "define", "source"])
def test_a_changed_input_compiles_again(cuda, store, tmp_path, change):
    _compile(cuda, _project(tmp_path / "a"), tmp_path / "out-a")
    project = _project(tmp_path / "b", scale="4.0f" if change == "header" else "2.0f")
    if change == "source":
        (project / "kernel.cu").write_text(KERNEL.replace("*=", "+="))
    _compile(cuda, project, tmp_path / "out-b", factor="5.0f" if change == "define" else "3.0f")
    assert not _reused(tmp_path / "out-b")
    ptx = (tmp_path / "out-b" / "keep" / "kernel.ptx").read_text()
    expected = {"header": "0f41400000", "define": "0f41200000", "source": "add.f32"}[change]  # 12.0, 10.0
    assert expected in ptx, ptx[-1500:]


def test_without_the_variable_every_compile_runs(cuda, tmp_path, monkeypatch):
    monkeypatch.setenv(nvcc_cache.CACHE_ENV, "")
    project = _project(tmp_path / "a")
    _compile(cuda, project, tmp_path / "out-a")
    _compile(cuda, project, tmp_path / "out-b")
    assert not _reused(tmp_path / "out-b")


def test_a_failed_compile_is_not_kept(cuda, store, tmp_path):
    project = _project(tmp_path / "a")
    (project / "kernel.cu").write_text(KERNEL + "this is not CUDA;\n")
    for attempt in ("out-a", "out-b"):
        with pytest.raises(ab.BuildError, match="nvcc failed"):
            _compile(cuda, project, tmp_path / attempt)
    assert not [p for p in store.rglob(nvcc_cache.RESULT)]


def test_a_broken_entry_is_compiled_again(cuda, store, tmp_path):
    project = _project(tmp_path / "a")
    _compile(cuda, project, tmp_path / "out-a")
    (result,) = store.rglob(nvcc_cache.RESULT)
    (result.parent / "output").unlink()  # e.g. a disk that filled while it was stored
    _compile(cuda, project, tmp_path / "out-b")
    assert not _reused(tmp_path / "out-b") and (tmp_path / "out-b" / "kernel.cubin").stat().st_size > 0


def test_dependency_listings_are_never_kept(tmp_path):
    # -M prints paths of this tree: reused elsewhere, they would name another tree's files
    args = ["-M", "-o", str(tmp_path / "deps.d"), str(tmp_path / "kernel.cu")]
    assert nvcc_cache.outputs_of(args) is None
    assert nvcc_cache.outputs_of(["-cubin", str(tmp_path / "kernel.cu")]) is None  # no -o: nothing to keep


def test_a_file_named_by_a_define_counts_by_its_bytes(cuda, store, tmp_path):
    """The GPU harness includes the activation part through -DDIST_ACTIVATION_SOURCE="path"."""
    def compile_with(part: Path, body: str, out: str) -> bool:
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_text(body)
        (tmp_path / "main.cu").write_text("#include DIST_PART\n")
        ab.nvcc(cuda, ["-gencode=arch=compute_90a,code=sm_90a", f'-DDIST_PART="{part}"', "-cubin",
                       "-o", str(tmp_path / f"{out}.cubin"), str(tmp_path / "main.cu")], tmp_path / f"{out}.log")
        return nvcc_cache.REUSED in (tmp_path / f"{out}.log").read_text()

    body = "__global__ void k(float* x) { x[0] = 1.0f; }\n"
    assert not compile_with(tmp_path / "a" / "part.cu", body, "first")
    assert compile_with(tmp_path / "b" / "part.cu", body, "moved")  # the same bytes elsewhere
    assert not compile_with(tmp_path / "b" / "part.cu", body.replace("1.0f", "2.0f"), "changed")


def test_the_store_drops_what_was_used_longest_ago(cuda, store, tmp_path):
    entries = []  # in the order compiled, each dated a second after the one before
    for n, factor in enumerate(("3.0f", "4.0f", "5.0f")):
        before = set(store.glob("??/*"))
        _compile(cuda, _project(tmp_path / f"p{n}"), tmp_path / f"out{n}", factor=factor)
        (entry,) = set(store.glob("??/*")) - before
        os.utime(entry, (1_000_000 + n, 1_000_000 + n))
        entries.append(entry)
    _compile(cuda, _project(tmp_path / "again"), tmp_path / "again-out", factor="3.0f")  # the oldest, used now
    assert _reused(tmp_path / "again-out")
    nvcc_cache.prune(store, max_bytes=2 * max(nvcc_cache._size(e) for e in entries))
    assert set(store.glob("??/*")) == {entries[0], entries[2]}
