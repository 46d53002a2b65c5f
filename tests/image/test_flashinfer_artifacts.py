"""FlashInfer's artifact set as a pinned input: fetched from a mirror along
FlashInfer's hash chain (the pin in artifacts.py -> checksums.txt -> each file),
written atomically, served from the cache offline, staged for the image, and
checked in the image (imagectl.flashinfer_aot.check_cubin_dir).

The store is one the test makes: a FlashInfer-shaped tree whose artifacts.py
pins the test's manifests (the root of trust is the tree passed explicitly,
never an environment variable), served by a real HTTP server on loopback and
as a local folder. The real patched tree's pins are read as well.
"""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from distbuild import cli

from distbuild.host import image
from distbuild import flashinfer_artifacts as fa
from distbuild.errors import DistBuildError
from distbuild.paths import Layout
from imagectl import flashinfer_aot

REPO = Path(__file__).resolve().parents[2]
BMM = "0123abcd/batched_gemm-test/"
FMHA = "4567ef01/fmha/trtllm-gen/"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Store:
    """A fake FlashInfer store (folder) and a FlashInfer-shaped tree pinning its manifests."""
    folder: Path
    tree: Path
    files: dict[str, bytes]          # store-relative path -> content (manifests excluded)
    manifests: dict[str, bytes]      # store-relative manifest path -> content

    def corrupt(self, name: str) -> None:
        (self.folder / name).write_bytes(b"not what the manifest says")


def _manifest(files: dict[str, bytes]) -> bytes:
    return "".join(f"{sha(data)}  {name}\n" for name, data in sorted(files.items())).encode()


def make_store(root: Path, store_url: str = "https://store.invalid/artifactory/") -> Store:
    contents = {
        BMM: {"include/flashinferMetaInfo.h": b"// bmm kernel list\n",
              "include/trtllmGen_bmm_export/BatchedGemmInterface.h": b"#pragma once\n",
              "include/trtllmGen_bmm_export/trtllm/gen/CudaArchDecl.h": b"#pragma once // arch\n",
              "Bmm_E4m3_sm100f.cubin": os.urandom(3000), "Bmm_E4m3_sm103a.cubin": os.urandom(200_000)},
        FMHA: {"include/flashInferMetaInfo.h": b"// fmha kernel list\n",
               "fmhaSm100fKernel_QE4m3.cubin": os.urandom(5000)},
    }
    folder, tree = root / "store", root / "flashinfer-tree"
    files, manifests = {}, {}
    for prefix, entries in contents.items():
        for name, data in entries.items():
            path = folder / prefix / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            files[prefix + name] = data
        manifests[prefix + "checksums.txt"] = _manifest(entries)
        (folder / prefix / "checksums.txt").write_bytes(manifests[prefix + "checksums.txt"])
    (tree / "flashinfer" / "jit").mkdir(parents=True)
    (tree / "flashinfer" / "artifacts.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass(frozen=True)\nclass ArtifactPath:\n"
        f'    TRTLLM_GEN_FMHA: str = "{FMHA}"\n    TRTLLM_GEN_BMM: str = (\n        "{BMM}"\n    )\n'
        '    DEEPGEMM: str = "elsewhere/deep-gemm/"\n\n\nclass CheckSumHash:\n'
        f'    TRTLLM_GEN_FMHA: str = "{sha(manifests[FMHA + "checksums.txt"])}"\n'
        f'    TRTLLM_GEN_BMM: str = (\n        "{sha(manifests[BMM + "checksums.txt"])}"\n    )\n'
        f'    DEEPGEMM: str = "{"0" * 64}"\n')
    (tree / "flashinfer" / "jit" / "cubin_loader.py").write_text(
        'import os\nFLASHINFER_CUBINS_REPOSITORY = os.environ.get(\n    "FLASHINFER_CUBINS_REPOSITORY",\n'
        f'    "{store_url}",\n)\n')
    return Store(folder, tree, files, manifests)


@contextmanager
def http_mirror(folder: Path):
    """A real HTTP server on loopback serving ``folder`` (FlashInfer's store layout)."""
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".partial" in p.name)


@pytest.fixture(autouse=True)
def _no_shared_cache(monkeypatch) -> None:
    """The verb's cache is the test's work/ folder, and no site mirror leaks in."""
    monkeypatch.delenv("DIST_CACHE_DIR", raising=False)
    monkeypatch.delenv("FLASHINFER_CUBINS_REPOSITORY", raising=False)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return make_store(tmp_path)


def test_the_patched_tree_pins_the_artifacts_the_serving_modules_need() -> None:
    tree = Path(os.environ.get("DIST_WORK") or REPO / "work") / "src" / "flashinfer"
    assert (tree / "flashinfer" / "artifacts.py").is_file(), f"no patched FlashInfer tree at {tree}: run `make patched`"
    pins = fa.read_pins(tree)
    by_key = {a.key: a for a in pins.artifacts}
    assert list(by_key) == ["TRTLLM_GEN_BMM", "TRTLLM_GEN_FMHA"]
    source = (tree / "flashinfer" / "artifacts.py").read_text()
    for artifact in pins.artifacts:     # both strings appear in FlashInfer's own file, unmodified
        assert artifact.manifest_sha256 in source and artifact.path in source
    assert pins.store.startswith("https://") and pins.store in (tree / "flashinfer/jit/cubin_loader.py").read_text()
    modules = {m.name: m.artifacts for m in flashinfer_aot.MODULES}
    assert {k for arts in modules.values() for k in arts} == set(fa.NEEDED)
    assert modules["fused_moe_trtllm_sm100"] == ("TRTLLM_GEN_BMM",) and modules["fmha_gen"] == ("TRTLLM_GEN_FMHA",)


def test_http_mirror_fetch_then_offline_from_the_cache(store: Store, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    pins = fa.read_pins(store.tree)
    assert pins.store == "https://store.invalid/artifactory/"
    with http_mirror(store.folder) as url:
        first = fa.fetch_set(pins, fa.Mirror(url), cache, log=lambda _: None)
    assert first.fetched == len(store.files) + 2 and first.cached == 0
    for name, data in {**store.files, **store.manifests}.items():
        assert (cache / name).read_bytes() == data
    record = json.loads((cache / fa.RECORD).read_text())
    assert [a["key"] for a in record["artifacts"]] == ["TRTLLM_GEN_BMM", "TRTLLM_GEN_FMHA"]
    assert fa.set_status(cache, deep=True).complete
    # The server is gone: a second run is served from the cache, no request made.
    second = fa.fetch_set(pins, fa.Mirror(closed_port_url()), cache, log=lambda _: None)
    assert second.fetched == 0 and second.cached == len(store.files) + 2


def test_corrupted_cubin_refused_with_both_hashes_and_nothing_half_written(store: Store, tmp_path: Path) -> None:
    bad = BMM + "Bmm_E4m3_sm103a.cubin"
    store.corrupt(bad)
    cache = tmp_path / "cache"
    with http_mirror(store.folder) as url, pytest.raises(DistBuildError) as err:
        fa.fetch_set(fa.read_pins(store.tree), fa.Mirror(url), cache, log=lambda _: None)
    message = str(err.value)
    assert bad in message
    assert f"expected {sha(store.files[bad])}" in message
    assert f"got {sha(b'not what the manifest says')}" in message
    assert not (cache / bad).exists() and leftovers(cache) == []
    assert not (cache / fa.RECORD).exists() and not fa.set_status(cache).complete


def test_corrupted_manifest_refused_against_the_pin(store: Store, tmp_path: Path) -> None:
    manifest = BMM + "checksums.txt"
    pinned = sha(store.manifests[manifest])
    (store.folder / manifest).write_bytes(store.manifests[manifest] + f"{'1' * 64}  extra.cubin\n".encode())
    cache = tmp_path / "cache"
    with pytest.raises(DistBuildError) as err:
        fa.fetch_set(fa.read_pins(store.tree), fa.Mirror(str(store.folder)), cache, log=lambda _: None)
    message = str(err.value)
    assert manifest in message and f"expected {pinned}" in message and "CheckSumHash.TRTLLM_GEN_BMM" in message
    assert f"got {sha((store.folder / manifest).read_bytes())}" in message
    assert not (cache / manifest).exists() and leftovers(cache) == []


def test_local_folder_mirror_and_a_corrupt_cache_entry_refetched(store: Store, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    pins = fa.read_pins(store.tree)
    fa.fetch_set(pins, fa.Mirror(store.folder.as_uri()), cache, log=lambda _: None)
    victim = FMHA + "fmhaSm100fKernel_QE4m3.cubin"
    (cache / victim).write_bytes(b"bit rot")
    assert fa.set_status(cache, deep=True).missing == [victim]
    again = fa.fetch_set(pins, fa.Mirror(str(store.folder)), cache, log=lambda _: None)
    assert again.fetched == 1 and (cache / victim).read_bytes() == store.files[victim]


def test_unreachable_mirror_is_a_clear_error(store: Store, tmp_path: Path) -> None:
    url = closed_port_url()
    cache = tmp_path / "cache"
    with pytest.raises(DistBuildError) as err:
        fa.fetch_set(fa.read_pins(store.tree), fa.Mirror(url), cache, log=lambda _: None)
    assert f"FlashInfer artifact mirror {url}: cannot fetch {BMM}checksums.txt" in str(err.value)
    assert "refused" in str(err.value).lower()
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))
    with pytest.raises(DistBuildError, match="no such folder"):
        fa.Mirror(str(tmp_path / "nowhere"))


def test_manifest_with_a_path_outside_the_artifact_is_refused(store: Store, tmp_path: Path) -> None:
    evil = _manifest({"../../etc/evil.cubin": b"x"})
    (store.folder / FMHA / "checksums.txt").write_bytes(evil)
    tree_pins = fa.read_pins(store.tree)
    pins = fa.Pins(tree_pins.store, tuple(fa.Artifact(a.key, a.path, sha(evil) if a.path == FMHA else a.manifest_sha256)
                                          for a in tree_pins.artifacts))
    with pytest.raises(DistBuildError, match=r"checksums.txt:1: '../../etc/evil.cubin' is not a plain relative path"):
        fa.fetch_set(pins, fa.Mirror(str(store.folder)), tmp_path / "cache", log=lambda _: None)


def test_cli_verb_fetches_and_checks(store: Store, tmp_path: Path, capsys) -> None:
    work = tmp_path / "work"
    with http_mirror(store.folder) as url:
        assert cli.main(["--work", str(work), "flashinfer-artifacts", "--tree", str(store.tree), "--mirror", url]) == 0
    assert "file(s) verified" in capsys.readouterr().out
    assert cli.main(["--work", str(work), "flashinfer-artifacts", "--check", "--deep"]) == 0
    (work / "cache" / fa.CACHE_SUBDIR / BMM / "Bmm_E4m3_sm100f.cubin").unlink()
    assert cli.main(["--work", str(work), "flashinfer-artifacts", "--check"]) == 1
    assert f"missing  {BMM}Bmm_E4m3_sm100f.cubin" in capsys.readouterr().err
    assert cli.main(["--work", str(work), "flashinfer-artifacts", "--tree", str(tmp_path / "none")]) == 2


def test_stage_for_the_image_and_release(store: Store, tmp_path: Path) -> None:
    repo, work = tmp_path / "repo", tmp_path / "work"
    context = repo / "build" / fa.CACHE_SUBDIR
    context.mkdir(parents=True)
    (context / "README.md").write_text("kept\n")
    (context / "stale.cubin").write_text("from an older set\n")
    layout = Layout(repo=repo, work=work)
    with pytest.raises(DistBuildError,
                       match=r"RELEASE=1: no complete FlashInfer artifact set .*make flashinfer-artifacts"):
        image._stage_flashinfer_artifacts(layout, image.Options(release=True), log=lambda _: None)
    assert sorted(p.name for p in context.iterdir()) == ["README.md"]
    fa.fetch_set(fa.read_pins(store.tree), fa.Mirror(str(store.folder)), layout.cache / fa.CACHE_SUBDIR,
                 log=lambda _: None)
    assert image._stage_flashinfer_artifacts(layout, image.Options(release=True), log=lambda _: None).complete
    for name, data in store.files.items():
        assert (context / name).read_bytes() == data
    assert (context / "README.md").read_text() == "kept\n" and not (context / "stale.cubin").exists()


def test_image_check_of_the_cubin_dir(store: Store, tmp_path: Path) -> None:
    cubins = tmp_path / "cubins"
    fa.fetch_set(fa.read_pins(store.tree), fa.Mirror(str(store.folder)), cubins, log=lambda _: None)
    assert flashinfer_aot.check_cubin_dir(cubins, deep=True) == []
    assert "not set" in flashinfer_aot.check_cubin_dir("")[0]
    assert f"{fa.RECORD}: missing" in flashinfer_aot.check_cubin_dir(tmp_path)[0]
    (cubins / FMHA / "fmhaSm100fKernel_QE4m3.cubin").write_bytes(b"changed")
    (cubins / BMM / "include/flashinferMetaInfo.h").unlink()
    assert flashinfer_aot.check_cubin_dir(cubins) == [f"{cubins / BMM / 'include/flashinferMetaInfo.h'}: missing"]
    deep = flashinfer_aot.check_cubin_dir(cubins, deep=True)
    assert len(deep) == 2 and "fmhaSm100fKernel_QE4m3.cubin: sha256 does not match" in deep[1]


def test_aot_stage_without_a_set_reports_what_is_missing(store: Store, tmp_path: Path, capsys) -> None:
    empty, out = tmp_path / "cubins-in", tmp_path / "out"
    empty.mkdir()
    assert flashinfer_aot.build(store.tree, empty, out, out / "flashinfer-aot.json") == 0
    status = json.loads((out / "flashinfer-aot.json").read_text())
    assert status["status"] == "missing" and status["cubin_dir"] == "" and status["module"] == "fused_moe_trtllm_sm100"
    assert status["missing"] == [f"{BMM}checksums.txt (pinned) and every file it lists",
                                 f"{FMHA}checksums.txt (pinned) and every file it lists"]
    assert "TRTLLM_GEN_BMM" in status["consequence"] and "make flashinfer-artifacts" in status["consequence"]
    assert status["consequence"].startswith("development image: needs FlashInfer's artifact store at first use: ")
    assert (out / "cubins").is_dir() and not any((out / "cubins").iterdir())
    assert "flashinfer-aot: NOT BUILT" in capsys.readouterr().err


def test_aot_stage_refuses_a_corrupt_staged_set(store: Store, tmp_path: Path, capsys) -> None:
    staged, out = tmp_path / "cubins-in", tmp_path / "out"
    fa.fetch_set(fa.read_pins(store.tree), fa.Mirror(str(store.folder)), staged, log=lambda _: None)
    (staged / BMM / "Bmm_E4m3_sm103a.cubin").write_bytes(b"swapped after staging")
    assert flashinfer_aot.build(store.tree, staged, out, out / "flashinfer-aot.json") == 1
    err = capsys.readouterr().err
    assert "the staged artifact set is corrupt" in err and f"{BMM}Bmm_E4m3_sm103a.cubin" in err
    assert f"got {sha(b'swapped after staging')}" in err
    assert not (out / "cubins" / BMM / "Bmm_E4m3_sm103a.cubin").exists() and leftovers(out) == []


def test_aot_stage_refuses_a_set_fetched_for_other_pins(store: Store, tmp_path: Path) -> None:
    staged, out = tmp_path / "cubins-in", tmp_path / "out"
    fa.fetch_set(fa.read_pins(store.tree), fa.Mirror(str(store.folder)), staged, log=lambda _: None)
    artifacts_py = store.tree / "flashinfer" / "artifacts.py"   # a FlashInfer bump: new pins, old cached set
    artifacts_py.write_text(artifacts_py.read_text().replace(BMM, "fedcba98/batched_gemm-next/"))
    assert flashinfer_aot.build(store.tree, staged, out, out / "flashinfer-aot.json") == 0
    status = json.loads((out / "flashinfer-aot.json").read_text())
    assert status["status"] == "missing" and "fetched for other pins" in status["reason"]
    assert status["missing"][0] == "fedcba98/batched_gemm-next/checksums.txt"
