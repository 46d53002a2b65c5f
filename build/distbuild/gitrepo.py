"""A small git wrapper with a fixed identity and clock, isolated from user config.

Fixed author, committer and dates make the pristine and patched commits (and
so their hashes) the same on every machine.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .errors import DistBuildError

FIXED_NAME = "GLM-5.3 B300 distribution"
FIXED_EMAIL = "dist@localhost"
FIXED_DATE = "2000-01-01T00:00:00+00:00"
PREPARED_REF = "refs/dist/prepared"
PRISTINE_REF = "refs/dist/pristine"


def git_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_AUTHOR_NAME=FIXED_NAME,
        GIT_AUTHOR_EMAIL=FIXED_EMAIL,
        GIT_AUTHOR_DATE=FIXED_DATE,
        GIT_COMMITTER_NAME=FIXED_NAME,
        GIT_COMMITTER_EMAIL=FIXED_EMAIL,
        GIT_COMMITTER_DATE=FIXED_DATE,
        LC_ALL="C",
        TZ="UTC",
    )
    return env


class Repo:
    def __init__(self, path: Path) -> None:
        self.path = path

    def git(self, *args: str, check: bool = True, input: bytes | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["git", "-c", "core.autocrlf=false", "-c", "core.fileMode=true", "-c", "gc.auto=0", *args],
            cwd=self.path,
            env=env or git_env(),
            input=input,
            capture_output=True,
        )
        if check and result.returncode != 0:
            raise DistBuildError(
                f"git {' '.join(args)} failed in {self.path}: {result.stderr.decode(errors='replace').strip()}"
            )
        return result

    def out(self, *args: str) -> str:
        return self.git(*args).stdout.decode().strip()

    def init(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", "-b", "dist")

    def commit_all(self, message: str) -> str:
        self.git("add", "-A", "-f", ".")
        self.git("commit", "-q", "--allow-empty", "--no-verify", "-m", message)
        return self.head()

    def head(self) -> str:
        return self.out("rev-parse", "HEAD")

    def tree(self, rev: str = "HEAD") -> str:
        return self.out("rev-parse", f"{rev}^{{tree}}")

    def ref(self, name: str) -> str | None:
        result = self.git("rev-parse", "--verify", "-q", name, check=False)
        return result.stdout.decode().strip() if result.returncode == 0 else None

    def set_ref(self, name: str, rev: str) -> None:
        self.git("update-ref", name, rev)

    def dirty(self) -> list[str]:
        status = self.out("--no-optional-locks", "status", "--porcelain", "--untracked-files=all", "--ignored=no")
        return [line for line in status.splitlines() if line.strip()]

    def is_repo(self) -> bool:
        return (self.path / ".git").exists()

    def extract(self, rev: str, dest: Path) -> None:
        """Write the files of ``rev`` (a commit or tree) into ``dest`` (no .git)."""
        dest.mkdir(parents=True, exist_ok=True)
        archive = self.git("archive", "--format=tar", rev).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
