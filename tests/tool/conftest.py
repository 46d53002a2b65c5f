"""A throwaway distribution repo with its own upstream, served from a real
PEP 503 index on disk (file://), so the build tool runs end to end offline."""
from __future__ import annotations

import hashlib
import io
import os
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))

from distbuild import cli  # noqa: E402
from distbuild.pins import Pin, save  # noqa: E402

BASE_FILES = {
    "setup.py": "from setuptools import setup\nsetup(name='demo')\n",
    "demo/__init__.py": "VERSION = '1.0'\n",
    "demo/core.py": "".join(f"def f{i}():\n    return {i}\n\n" for i in range(40)),
}


def make_sdist(path: Path, top: str, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            info.mtime = 0
            archive.addfile(info, io.BytesIO(data))


@dataclass
class DemoRepo:
    root: Path
    work: Path
    index: Path
    files: Path

    def run(self, *args: str) -> int:
        return cli.main(["--repo", str(self.root), "--work", str(self.work), *args])

    def publish(self, version: str, files: dict[str, str]) -> Pin:
        """Put demo-VERSION.tar.gz on the on-disk index; return its pin."""
        filename = f"demo-{version}.tar.gz"
        path = self.files / filename
        make_sdist(path, f"demo-{version}", files)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        page = self.index / "demo" / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        links = page.read_text() if page.exists() else ""
        links += f'<a href="../../files/{filename}#sha256={digest}">{filename}</a>\n'
        page.write_text(links)
        return Pin("demo", version, "sdist", "upstream", filename, digest, path.stat().st_size, upstream="demo")

    def pin(self, pin: Pin) -> None:
        save(self.root / "build" / "pins.toml", [pin])

    def series(self, *patches: tuple[str, str]) -> Path:
        directory = self.root / "patches" / "demo"
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("*.patch"):
            old.unlink()
        for name, text in patches:
            (directory / name).write_text(text)
        (directory / "series").write_text("".join(f"{name}\n" for name, _ in patches))
        return directory


@pytest.fixture
def demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DemoRepo:
    root = tmp_path / "repo"
    (root / "build").mkdir(parents=True)
    index = tmp_path / "index" / "simple"
    files = tmp_path / "index" / "files"
    index.mkdir(parents=True)
    files.mkdir(parents=True)
    monkeypatch.setenv("PIP_INDEX_URL", index.as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.delenv("DIST_CACHE_DIR", raising=False)
    monkeypatch.delenv("DIST_WORK", raising=False)
    repo = DemoRepo(root=root, work=tmp_path / "work", index=index, files=files)
    repo.pin(repo.publish("1.0", BASE_FILES))
    return repo


def patch_text(subject: str, path: str, old: str, new: str, context_before: list[str], line: int) -> str:
    """A minimal git format-patch file replacing one line (followed by a blank line)."""
    count = len(context_before) + 2
    hunk = [f"@@ -{line},{count} +{line},{count} @@"]
    hunk += [f" {c}" for c in context_before] + [f"-{old}", f"+{new}", " "]
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: Dev <dev@localhost>\n"
        "Date: Sat, 1 Jan 2000 00:00:00 +0000\n"
        f"Subject: [PATCH] {subject}\n\n"
        "Why this change.\n\n"
        "Forwarded: not-yet\n"
        "Signed-off-by: Dev <dev@localhost>\n"
        "---\n"
        f"diff --git a/{path} b/{path}\n"
        f"--- a/{path}\n+++ b/{path}\n" + "\n".join(hunk) + "\n-- \n2.39.5\n\n"
    )


os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
