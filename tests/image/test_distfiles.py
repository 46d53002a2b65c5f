"""The self-test's installed-files check (image/imagectl/distfiles.py) on real wheels that
the test builds and real pip installs into a folder, as the image's pip installs the lock."""
from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from imagectl import distfiles, selftest


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(out: Path, name: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel with a correct RECORD."""
    dist_info = f"{name}-1.0.dist-info"
    entries = {**files,
               f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
               f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={_digest(data)},{len(data)}\n" for path, data in entries.items())
    record += f"{dist_info}/RECORD,,\n"
    wheel = out / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in entries.items():
            zf.writestr(path, data)
        zf.writestr(f"{dist_info}/RECORD", record)
    return wheel


def pip_install(target: Path, *wheels: Path | str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                           "--disable-pip-version-check", "--quiet", "--target", str(target), *map(str, wheels)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def wheels(tmp_path: Path) -> dict[str, Path]:
    out = tmp_path / "wheels"
    out.mkdir()
    return {
        "alpha": make_wheel(out, "alpha", {"alpha/__init__.py": b"A = 1\n", "shared_ns/__init__.py": b""}),
        "beta": make_wheel(out, "beta", {"beta/__init__.py": b"B = 1\n", "shared_ns/__init__.py": b""}),
        # claims alpha's module with other content, as two builds of one library would
        "gamma": make_wheel(out, "gamma", {"alpha/__init__.py": b"A = 2  # another build\n"}),
    }


def test_a_clean_install_passes_and_identical_shared_files_are_not_collisions(tmp_path, wheels) -> None:
    site = tmp_path / "site"
    pip_install(site, wheels["alpha"], wheels["beta"])
    report = distfiles.check_site(site)
    assert report.dists == 2 and not report.collisions and not report.mismatches
    assert list(report.shared) == [site / "shared_ns" / "__init__.py"]
    ok, detail = distfiles.describe(report, site)
    assert ok and "no path claimed twice, 1 identical file(s) shipped by more than one" in detail


def test_two_distributions_claiming_one_path_fail_naming_both(tmp_path, wheels) -> None:
    site = tmp_path / "site"
    pip_install(site, wheels["alpha"], wheels["gamma"])   # pip installs both without a word
    report = distfiles.check_site(site)
    assert list(report.collisions) == [site / "alpha" / "__init__.py"]
    assert sorted(e.dist for e in report.collisions[site / "alpha" / "__init__.py"]) == ["alpha 1.0", "gamma 1.0"]
    # one of the two RECORDs now describes a file that is not on disk
    assert [(e.dist, why) for e, why in report.mismatches] in ([("alpha 1.0", "hash differs from RECORD")],
                                                                [("gamma 1.0", "hash differs from RECORD")])
    ok, detail = distfiles.describe(report, site)
    assert not ok
    assert "1 path(s) claimed by two distributions with different content: alpha/__init__.py (" in detail
    check = selftest.check_installed_files(site)
    assert check.status == "FAIL" and check.detail == detail


def test_a_file_changed_or_removed_after_install_fails(tmp_path, wheels) -> None:
    site = tmp_path / "site"
    pip_install(site, wheels["alpha"], wheels["beta"])
    (site / "alpha" / "__init__.py").write_text("A = 'edited'\n")
    (site / "beta" / "__init__.py").unlink()
    report = distfiles.check_site(site)
    assert sorted((e.path.relative_to(site).as_posix(), why) for e, why in report.mismatches) == [
        ("alpha/__init__.py", "hash differs from RECORD"), ("beta/__init__.py", "missing")]
    assert selftest.check_installed_files(site).status == "FAIL"


def test_stale_byte_code_is_not_a_mismatch(tmp_path: Path) -> None:
    """A wheel's own .pyc, rewritten by Python's import once the .py is newer, is a cache."""
    out = tmp_path / "wheels"
    out.mkdir()
    wheel = make_wheel(out, "delta", {"delta/__init__.py": b"D = 1\n",
                                      "delta/__pycache__/__init__.cpython-311.pyc": b"old byte code"})
    site = tmp_path / "site"
    pip_install(site, wheel)
    pyc = site / "delta" / "__pycache__" / "__init__.cpython-311.pyc"
    pyc.write_bytes(b"recompiled")
    rows = {e.path: e for e in distfiles.record_entries(site / "delta-1.0.dist-info")}
    assert rows[pyc].sha256 == _digest(b"old byte code") != distfiles.file_digest(pyc)
    report = distfiles.check_site(site)
    assert not report.mismatches


def test_reviewed_exceptions_pass_only_for_the_named_path_and_distributions(tmp_path) -> None:
    """The image's two known cases, rebuilt with real wheels: flashinfer-python and
    torch_c_dlpack_ext both ship a top-level build_backend.py (the later install wins, so
    the other's RECORD no longer matches). Accepted for exactly those two distributions; the
    same collision between any other pair still fails."""
    out = tmp_path / "wheels"
    out.mkdir()
    first = make_wheel(out, "torch_c_dlpack_ext", {"build_backend.py": b"# dlpack's backend\n"})
    second = make_wheel(out, "flashinfer_python", {"build_backend.py": b"# flashinfer's backend\n"})
    site = tmp_path / "site"
    pip_install(site, first)
    # into a venv the later install overwrites the file; pip --target needs --upgrade for that
    pip_install(site, second, "--upgrade")
    report = distfiles.check_site(site)
    assert report.collisions and report.mismatches          # the raw facts are still reported
    assert [e.dist for e, _ in report.mismatches] == ["torch_c_dlpack_ext 1.0"]
    ok, detail = distfiles.describe(report, site)
    assert ok, detail
    assert "reviewed exception" in detail and "build_backend.py" in detail

    other = make_wheel(out, "somepkg", {"build_backend.py": b"# yet another\n"})
    pip_install(site, other, "--upgrade")
    ok, detail = distfiles.describe(distfiles.check_site(site), site)
    assert not ok and "build_backend.py" in detail and "somepkg" in detail
