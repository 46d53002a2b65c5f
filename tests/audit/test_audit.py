"""The arch audit on objects compiled here for sm_103a, sm_100a, sm_100f, sm_100, sm_90a,
sm_120 and PTX only, in a folder, as single files, and inside an OCI image."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from distbuild import cli
from distbuild.host.audit import Report, audit, has_cuda_code, read_cubin

# object -> (verdict for sm_103, every target it carries)
EXPECTED = {
    "libsm103a.so": ("native", {"sm_103a"}),
    "libsm100a.so": ("not-runnable", {"sm_100a"}),
    "libsm100f.so": ("family", {"sm_100f"}),
    "libsm100.so": ("same-major", {"sm_100"}),
    "libsm90a.so": ("not-runnable", {"sm_90a"}),
    "libptx100.so": ("ptx-only", {"compute_100"}),
    "libmixed.so.1": ("family", {"sm_90a", "sm_100f", "compute_90"}),
    "sm100f.cubin": ("family", {"sm_100f"}),
    "sm100a.cubin": ("not-runnable", {"sm_100a"}),
    "sm100.cubin": ("same-major", {"sm_100"}),
    "sm120.cubin": ("not-runnable", {"sm_120"}),
    "kernels.fatbin": ("not-runnable", {"sm_100a", "compute_100a"}),
}
FAILING = {name for name, (verdict, _) in EXPECTED.items() if verdict in ("ptx-only", "not-runnable")}


@pytest.fixture(scope="module")
def report(objects: Path, cuobjdump: Path) -> Report:
    return audit(objects, "sm_103", cuobjdump)


def _by_path(report: Report) -> dict:
    return {o.path: o for o in report.objects}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_object_is_classified_for_b300(report: Report, name: str) -> None:
    verdict, archs = EXPECTED[name]
    obj = _by_path(report)[name]
    assert (obj.verdict, {e.arch for e in obj.entries}) == (verdict, archs)


def test_report_covers_exactly_the_objects(report: Report) -> None:
    assert set(_by_path(report)) == set(EXPECTED)
    assert report.input == "folder" and report.target == "sm_103" and not report.passed
    assert {o.path for o in report.failing} == FAILING


def test_mixed_object_keeps_every_entry(report: Report) -> None:
    entries = {e.arch: e.verdict for e in _by_path(report)["libmixed.so.1"].entries}
    assert entries == {"sm_100f": "family", "sm_90a": "not-runnable", "compute_90": "ptx-only"}


def test_family_suffix_comes_from_the_cubin_not_from_list_elf(objects: Path, cuobjdump: Path, report: Report) -> None:
    listing = subprocess.run([str(cuobjdump), "--list-elf", str(objects / "libsm100f.so")],
                             capture_output=True, text=True, check=True).stdout
    assert ".sm_100.cubin" in listing and "sm_100f" not in listing  # the premise: --list-elf hides the f
    (entry,) = _by_path(report)["libsm100f.so"].entries
    assert (entry.arch, entry.source, entry.toolkit) == ("sm_100f", "tkinfo", "13.0")


def test_elf_layout(objects: Path) -> None:
    """e_flags carry the SM number in bits 8-15 and nothing about a/f; the suffix lives elsewhere."""
    plain, family, specific = (read_cubin(objects / f"sm100{s}.cubin") for s in ("", "f", "a"))
    assert plain.abi == family.abi == specific.abi == 8
    assert plain.flags == family.flags == specific.flags and (plain.flags >> 8) & 0xFF == 100
    assert (read_cubin(objects / "sm120.cubin").flags >> 8) & 0xFF == 120
    assert [c.ptxas and c.ptxas.suffix for c in (plain, family, specific)] == ["", "f", "a"]
    assert [c.arch_specific for c in (plain, family, specific)] == [False, False, True]


def test_other_target(objects: Path, cuobjdump: Path) -> None:
    found = _by_path(audit(objects, "sm_100", cuobjdump))
    assert found["libsm100a.so"].verdict == "native"
    assert found["libsm103a.so"].verdict == "not-runnable"
    assert found["kernels.fatbin"].verdict == "native"


def test_single_files(objects: Path, cuobjdump: Path) -> None:
    one = audit(objects / "kernels.fatbin", "sm_103", cuobjdump)
    assert one.input == "file" and [(o.path, o.verdict) for o in one.objects] == [("kernels.fatbin", "not-runnable")]
    assert audit(objects / "libsm103a.so", "sm_103", cuobjdump).passed


# --- the gate and the allowlist, through the CLI -------------------------------------------

def _gate(path: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    code = cli.main(["--work", str(tmp_path / "work"), "audit", str(path), "--json", str(out), *extra])
    return code, json.loads(out.read_text())


def test_gate_fails_on_unrunnable_code(objects: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, data = _gate(objects, tmp_path)
    assert code == 1 and not data["passed"] and set(data["failing"]) == FAILING
    assert data["summary"] == {"native": 1, "family": 3, "same-major": 2, "ptx-only": 1, "not-runnable": 5}
    out = capsys.readouterr().out
    assert "FAIL: 6 object(s)" in out and "libsm100a.so" in out


def test_allowlist_covers_everything(objects: Path, tmp_path: Path) -> None:
    allow = tmp_path / "allow.txt"
    allow.write_text("libsm*a.so   Hopper/B200-only test kernels\nlibptx100.so  JIT on first use is accepted\n"
                     "*.fatbin  only loaded on B200\nsm1*.cubin  test cubins for other GPUs\n")
    code, data = _gate(objects, tmp_path, "--allowlist", str(allow))
    assert code == 0 and data["passed"] and data["failing"] == []
    allowed = {o["path"]: o["reason"] for o in data["objects"] if o["allowed"]}
    assert allowed == {"libsm100a.so": "Hopper/B200-only test kernels", "libsm90a.so": "Hopper/B200-only test kernels",
                       "libptx100.so": "JIT on first use is accepted", "kernels.fatbin": "only loaded on B200",
                       "sm100a.cubin": "test cubins for other GPUs", "sm120.cubin": "test cubins for other GPUs"}


def test_allowlist_partly_covers(objects: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    allow = tmp_path / "allow.txt"
    allow.write_text("libsm90a.so  Hopper-only, like vLLM's FA3\nlibnothing.so  stale entry\n")
    code, data = _gate(objects, tmp_path, "--allowlist", str(allow))
    assert code == 1 and set(data["failing"]) == FAILING - {"libsm90a.so"}
    assert data["unused_allowlist"] == [f"{allow}:2: libnothing.so"]
    out = capsys.readouterr().out
    assert "[allowed, " in out and "Hopper-only, like vLLM's FA3" in out
    assert "covers nothing that needs it" in out


def test_allowlist_without_reason_is_an_error(objects: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    allow = tmp_path / "allow.txt"
    allow.write_text("libsm90a.so  Hopper-only\nlibsm100a.so\n")
    assert cli.main(["--work", str(tmp_path / "work"), "audit", str(objects), "--allowlist", str(allow)]) == 2
    assert f"{allow}:2: allowlist entry 'libsm100a.so' has no reason" in capsys.readouterr().err


# --- no CUDA code ------------------------------------------------------------------------

def _host_extension() -> Path | None:
    for name in ("_json", "_ctypes", "_struct", "math"):
        module = __import__(name)
        if getattr(module, "__file__", None):
            return Path(module.__file__)
    return None


def test_folder_without_cuda_code_passes(tmp_path: Path, cuobjdump: Path) -> None:
    folder = tmp_path / "plain"
    (folder / "lib").mkdir(parents=True)
    (folder / "README").write_text("no GPU code here\n")
    (folder / "lib" / "libfake.so").write_bytes(b"not an ELF at all")
    host = _host_extension()
    if host is not None:
        (folder / "lib" / host.name).write_bytes(host.read_bytes())
        assert not has_cuda_code(folder / "lib" / host.name)
    report = audit(folder, "sm_103", cuobjdump)
    assert report.objects == [] and report.passed and report.scanned == (2 if host else 1)
    assert cli.main(["--work", str(tmp_path / "work"), "audit", str(folder)]) == 0


# --- OCI images -------------------------------------------------------------------------

def _tar(entries: list[tuple[str, bytes | str]], compress: bool) -> bytes:
    """A layer: (name, bytes) is a file, (name, 'link:TARGET') a symbolic link."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, content in entries:
            info = tarfile.TarInfo(name)
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content.removeprefix("link:")
                archive.addfile(info)
            else:
                info.size = len(content)
                archive.addfile(info, io.BytesIO(content))
    data = buffer.getvalue()
    return gzip.compress(data, mtime=0) if compress else data


def _blob(layout: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    path = layout / "blobs" / "sha256" / digest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return f"sha256:{digest}"


def _oci_layout(layout: Path, layers: list[tuple[bytes, bool]]) -> None:
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}})
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _blob(layout, config.encode()),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else ""),
                    "digest": _blob(layout, data), "size": len(data)} for data, gz in layers],
    }
    body = json.dumps(manifest).encode()
    entry = {"mediaType": manifest["mediaType"], "digest": _blob(layout, body), "size": len(body),
             "platform": {"architecture": "amd64", "os": "linux"}}
    index = {"schemaVersion": 2, "manifests": [entry]}
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')


@pytest.fixture(scope="module")
def oci_layout(objects: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layers: the second whites out one file and, opaquely, a whole folder of the first."""
    read = lambda name: (objects / name).read_bytes()  # noqa: E731
    base = _tar([("usr/lib/libsm100.so", read("libsm100.so")),
                 ("usr/lib/libold.so", read("libsm100a.so")),
                 ("opt/app/libsm90a.so", read("libsm90a.so")),
                 ("opt/app/notes.txt", b"text")], compress=False)
    top = _tar([("usr/lib/.wh.libold.so", b""),
                ("opt/app/.wh..wh..opq", b""),
                ("opt/app/libsm103a.so", read("libsm103a.so")),
                ("usr/lib/libsm100.so.1", "link:libsm100.so"),
                ("usr/local/lib/python3.11/site-packages/pkg/kernels.fatbin", read("kernels.fatbin"))], compress=True)
    layout = tmp_path_factory.mktemp("oci") / "image"
    _oci_layout(layout, [(base, False), (top, True)])
    return layout


IMAGE_EXPECTED = {
    "opt/app/libsm103a.so": "native",
    "usr/lib/libsm100.so": "same-major",
    "usr/local/lib/python3.11/site-packages/pkg/kernels.fatbin": "not-runnable",
}


def test_oci_layout_folder(oci_layout: Path, cuobjdump: Path) -> None:
    report = audit(oci_layout, "sm_103", cuobjdump)
    assert report.input == "oci-layout"
    assert {o.path: o.verdict for o in report.objects} == IMAGE_EXPECTED


def test_oci_archive(oci_layout: Path, tmp_path: Path, cuobjdump: Path) -> None:
    archive = tmp_path / "image.oci.tar"
    with tarfile.open(archive, "w") as tar:
        for path in sorted(oci_layout.rglob("*")):
            tar.add(path, arcname=path.relative_to(oci_layout).as_posix(), recursive=False)
    allow = tmp_path / "allow.txt"
    allow.write_text("*/site-packages/pkg/*.fatbin  B200-only kernels of a test package\n")
    code, data = _gate(archive, tmp_path, "--allowlist", str(allow))
    assert code == 0 and data["input"] == "oci-archive"
    assert {o["path"]: o["verdict"] for o in data["objects"]} == IMAGE_EXPECTED


def test_not_an_image(tmp_path: Path, cuobjdump: Path, capsys: pytest.CaptureFixture) -> None:
    archive = tmp_path / "random.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("hello.txt")
        tar.addfile(info, io.BytesIO(b""))
    assert cli.main(["--work", str(tmp_path / "work"), "audit", str(archive)]) == 2
    assert "neither an OCI image" in capsys.readouterr().err

