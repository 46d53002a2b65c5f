"""make lock resolves for the image's exact Python, not the one it runs on.

pip evaluates environment markers with its own interpreter, so a lock made on 3.11.7 left
out async-timeout, which redis requires on the image's 3.11.2. These tests run the real pip
(the lock's resolver) against a PEP 503 index on disk (file://, sha256 in the links) holding
small wheels whose requirements carry markers, and check that ``lock.resolve`` adds what
the image's Python needs, through a chain, and nothing it does not.

The markers name Python 3.11.1, a version no host that runs the lock has (it must be
3.11, and 3.11.1 is not a release anyone builds CI on), so pip itself never resolves them.
"""
from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))

from distbuild.host import markers  # noqa: E402

from distbuild.host import lock
from distbuild.errors import DistBuildError  # noqa: E402

ONLY_ON_3111 = 'python_full_version == "3.11.1"'


def _wheel(index: Path, files: Path, name: str, version: str, requires: list[str]) -> None:
    filename = f"{name}-{version}-py3-none-any.whl"
    path = files / filename
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    dist_info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", "")
        wheel.writestr(f"{dist_info}/METADATA", "\n".join(meta) + "\n")
        wheel.writestr(f"{dist_info}/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist_info}/RECORD", "")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    page = index / name / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    links = page.read_text() if page.exists() else ""
    page.write_text(links + f'<a href="../../files/{filename}#sha256={digest}">{filename}</a>\n')


@pytest.fixture
def index(tmp_path: Path) -> str:
    if f"{sys.version_info.major}.{sys.version_info.minor}" != lock.PYTHON_VERSION:
        pytest.fail(f"the lock (and this test) runs on Python {lock.PYTHON_VERSION}; this is {sys.version}")
    simple, files = tmp_path / "simple", tmp_path / "files"
    simple.mkdir()
    files.mkdir()
    _wheel(simple, files, "app", "1.0", ["plain>=1", f"needy>=2; {ONLY_ON_3111}",
                                         'never; python_version < "3.0"',
                                         f'extraonly; extra == "x" and {ONLY_ON_3111}'])
    _wheel(simple, files, "plain", "1.5", [])
    _wheel(simple, files, "needy", "1.0", [])
    _wheel(simple, files, "needy", "2.1", [f"chained; {ONLY_ON_3111}"])
    _wheel(simple, files, "chained", "0.3", [])
    _wheel(simple, files, "never", "1.0", [])
    _wheel(simple, files, "extraonly", "1.0", [])
    return simple.as_uri()


def test_resolve_adds_what_the_image_python_needs_through_a_chain(index, capsys):
    locked = lock.resolve(["app==1.0"], index, image_python="3.11.1")
    got = {x.name: x.version for x in locked}
    assert got == {"app": "1.0", "plain": "1.5", "needy": "2.1", "chained": "0.3"}
    assert all(len(x.sha256) == 64 for x in locked)
    out = capsys.readouterr().out
    assert "Python 3.11.1 also needs needy>=2 (for app" in out
    assert "Python 3.11.1 also needs chained (for needy" in out


def test_resolve_adds_nothing_when_the_markers_are_false_on_the_image_python(index, capsys):
    locked = lock.resolve(["app==1.0"], index, image_python="3.11.9")
    assert {x.name for x in locked} == {"app", "plain"}
    assert "also needs" not in capsys.readouterr().out


def test_requested_extras_count_for_the_top_level_request(index):
    locked = lock.resolve(["app[x]==1.0"], index, image_python="3.11.1")
    assert "extraonly" in {x.name for x in locked}


def test_missed_requirements_on_a_pip_report_item():
    install = [{"metadata": {"name": "redis", "version": "8.1.0",
                             "requires_dist": ['async-timeout>=4.0.3; python_full_version < "3.11.3"',
                                               'hiredis>=3; extra == "hiredis"']}}]
    missed = markers.missed_requirements(install, "3.11.2")
    assert [m.requirement for m in missed] == ["async-timeout>=4.0.3"]
    assert missed[0].needed_by == "redis" and "3.11.3" in missed[0].marker
    assert markers.missed_requirements(install, "3.11.3") == []


@pytest.mark.parametrize("version", ["3.11", "3.11.x", ""])
def test_a_malformed_image_python_is_refused(version):
    with pytest.raises(DistBuildError, match="expected MAJOR.MINOR.MICRO"):
        markers.marker_environment(version)


def test_an_unreadable_requirement_names_its_distribution():
    install = [{"metadata": {"name": "broken", "version": "1", "requires_dist": ["not a (valid requirement"]}}]
    with pytest.raises(DistBuildError, match="broken 1: unreadable Requires-Dist"):
        markers.missed_requirements(install, "3.11.2")
