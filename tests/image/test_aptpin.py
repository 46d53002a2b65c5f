"""build/lock/debian.txt and its reader (image/imagectl/aptpin.py, run inside each stage)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from distbuild.host import baseimage
from imagectl import aptpin

from .conftest import REPO

LOCK = REPO / "build" / "lock" / "debian.txt"
DOCKERFILE = REPO / "Dockerfile"


def test_the_lock_has_every_stage_with_versions_and_deb_hashes() -> None:
    sections = aptpin.parse_lock(LOCK.read_text())
    assert set(sections) == {"base", *baseimage.STAGE_PACKAGES}
    for stage, packages in baseimage.STAGE_PACKAGES.items():
        top, entries = sections[stage]
        assert top == list(packages)
        # each top-level package is in its stage's closure or already in the base
        for name in packages:
            assert name in entries or name in sections["base"][1], (stage, name)
    base = sections["base"][1]
    assert {"python3", "python3-venv", "ca-certificates", "libc6", "apt"} <= set(base)
    # the security suite is in: bookworm-security versions carry +debNNuM
    assert any("+deb12u" in version for version, _ in base.values())


def test_a_section_round_trips_and_a_bad_line_names_its_line() -> None:
    entries = {"b": ("1:2.0-1", "b" * 64), "a": ("1.0-1+deb12u1", "a" * 64)}
    text = aptpin.format_section("runtime", ["a", "b"], entries)
    assert text.splitlines()[1].startswith("a=1.0-1+deb12u1 ")   # sorted
    assert aptpin.parse_lock(text) == {"runtime": (["a", "b"], entries)}
    with pytest.raises(aptpin.PinError, match=r"line 2: 'gcc 12' is not 'name=version sha256'"):
        aptpin.parse_lock("[runtime] gcc\ngcc 12\n")
    with pytest.raises(aptpin.PinError, match=r"line 1: .* before any \[stage\] header"):
        aptpin.parse_lock("gcc=12 " + "0" * 64 + "\n")


def test_install_refuses_a_stage_the_lock_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock = tmp_path / "debian.txt"
    lock.write_text(aptpin.format_section("base", [], {"libc6": ("2.36-9", "c" * 64)}))
    assert aptpin.main(["install", "--lock", str(lock), "--stage", "runtime"]) == 1
    assert "no [runtime] section; run `make lock-debian`" in capsys.readouterr().err


def test_install_only_refuses_a_package_the_section_does_not_lock(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    lock = tmp_path / "debian.txt"
    lock.write_text(aptpin.format_section("runtime", ["tini"], {"tini": ("0.19.0-1+b3", "d" * 64)}))
    assert aptpin.main(["install", "--lock", str(lock), "--stage", "runtime", "--only", "tini", "dumb-init"]) == 1
    assert f"{lock}: [runtime] locks no dumb-init" in capsys.readouterr().err


def test_the_routers_tini_is_one_package_the_runtime_section_locks() -> None:
    """The router stage installs only tini of [runtime]: its closure there must be tini alone (its
    one dependency, libc6, is the base's), or the stage's install fails on what apt adds."""
    sections = aptpin.parse_lock(LOCK.read_text())
    assert "tini" in sections["runtime"][1]
    assert "libc6" in sections["base"][1]
    assert re.search(r"aptpin\.py install --lock \S+ --stage runtime --only tini\b", DOCKERFILE.read_text())


def test_the_base_is_labelled_with_its_lock_section_and_epoch() -> None:
    text = LOCK.read_text()
    digest = baseimage.section_digest(text)
    assert digest and len(digest) == 64
    # the header and other sections do not change the base's label; its own section does
    assert baseimage.section_digest("# a comment\n" + text) == digest
    changed = text.replace("[base] python3", "[base] python3 tini", 1)
    assert baseimage.section_digest(changed) != digest


def test_the_normalised_rootfs_tar_depends_on_content_only(tmp_path: Path) -> None:
    """Names created in another order and every mtime after the epoch, the roots' own included (a
    build's files are newer than its SOURCE_DATE_EPOCH): the same tar. The epoch is in the past, as a
    build's is; one after today would leave the roots' mtimes, the second each was made in, unclamped."""
    epoch = 1_700_000_000
    sums = []
    for n, (order, mtime) in enumerate((("ab", 1_900_000_000), ("ba", 1_950_000_000))):
        root = tmp_path / f"root{n}"
        root.mkdir()
        for name in order:   # created in another order: the tar sorts names
            (root / name).write_text(name)
            os.utime(root / name, (mtime, mtime))
        os.utime(root, (mtime + 1, mtime + 1))
        sums.append(baseimage.normalised_tar(root, tmp_path / f"r{n}.tar", epoch=epoch))
    assert sums[0] == sums[1]
    (tmp_path / "root1" / "a").write_text("changed")
    assert baseimage.normalised_tar(tmp_path / "root1", tmp_path / "r2.tar", epoch=epoch) != sums[0]


def test_a_version_the_suites_dropped_is_named_with_the_fix() -> None:
    """Real apt on this machine, asked (download only) for a version no suite has: the error
    names the stage, the pin and `make lock-debian` (tests/image/test_build.py skips a stage
    build on exactly this message, the lock's upkeep rather than a defect)."""
    import shutil as _shutil

    from tests.image.test_build import STALE_DEBIAN_PIN

    if _shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("needs apt-get as root")
    with pytest.raises(aptpin.PinError) as raised:
        aptpin.download("runtime", ["hostname=0.0.0-not-in-any-suite"])
    message = str(raised.value)
    assert "[runtime] hostname=0.0.0-not-in-any-suite: apt did not fetch it" in message
    assert "make lock-debian" in message
    assert STALE_DEBIAN_PIN.search(message)
