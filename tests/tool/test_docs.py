"""The documentation names only what exists.

For README.md, CHANGELOG.md, docs/*.md and every other README in the repository:

- every relative link resolves to a file or folder, and a ``#fragment`` to a heading of the
  Markdown file it points at;
- every ``make <target>`` in code (a code span that starts with ``make``, or a command line in
  a code block) is a target of the Makefile;
- every ``--flag`` on a command line of a project CLI (``scripts/<tool> [subcommand]``,
  ``python3 -m distbuild <subcommand>``, ``configs/validate.py``, ``configs/deploy/render.py``,
  ``tests/flashinfer/gpu/run.py``, ``benchmarks/*.py``) appears in that CLI's ``--help``.
  Flags after a bare ``--`` belong to the wrapped command and are not checked.

Scope: code blocks and code spans only, where a command is written out, so prose is never
misread as a command. A failure names the file, the line and the missing thing.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", "work", "__pycache__", ".pytest_cache", ".benchmarks", "node_modules"}
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+(?:\([^()\s]*\))?)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*")
HELP_FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
SCRIPT_TOOLS = ("replay", "valkey-stats", "needle", "profile-capture", "kv-sizing", "cellsim")
INTERPRETERS = re.compile(r"^(python3?|\S*/bin/python3?|pytest)$")


def doc_files() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        if "README.md" in files and Path(folder) != ROOT:
            found.append(Path(folder) / "README.md")
    return [p for p in found if p.is_file()]


@dataclass(frozen=True)
class Line:
    path: Path
    number: int
    text: str
    in_code: bool   # inside a fenced or indented code block

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.number}"


def lines_of(path: Path) -> Iterator[Line]:
    in_fence, previous_blank = False, True
    indented = False
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(text):
            in_fence = not in_fence
            previous_blank = False
            continue
        if not in_fence:
            if text.startswith("    ") and text.strip() and (previous_blank or indented):
                indented = True
            elif text.strip():
                indented = False
        yield Line(path, number, text, in_fence or indented)
        previous_blank = not text.strip()


def prose(text: str) -> str:
    """The line without its code spans (a link inside backticks is not a link)."""
    return CODE_SPAN.sub("", text)


# ---------------------------------------------------------------- links

def github_slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())   # a link's text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in lines_of(path):
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line.text)
        if line.in_code or not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(result)


def link_problems(path: Path) -> list[str]:
    problems = []
    for line in lines_of(path):
        if line.in_code:
            continue
        for match in LINK.finditer(prose(line.text)):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
                continue   # http:, https:, mailto: ...
            file_part, _, fragment = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                problems.append(f"{line.where()}: link target {target!r} does not exist ({resolved})")
                continue
            if fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                problems.append(f"{line.where()}: link {target!r}: no heading '#{fragment}' in "
                                f"{resolved.relative_to(ROOT)}")
    return problems


# ---------------------------------------------------------------- commands

def command_texts(path: Path) -> Iterator[tuple[Line, str]]:
    """Code written out: each code span, and each logical line of a code block (continuations
    joined), with the line it starts on."""
    pending: tuple[Line, str] | None = None
    for line in lines_of(path):
        if line.in_code:
            text = line.text.strip()
            if pending is not None:
                pending = (pending[0], pending[1] + " " + text)
            else:
                pending = (line, text)
            if pending[1].endswith("\\"):
                pending = (pending[0], pending[1][:-1])
                continue
            yield pending
            pending = None
        else:
            if pending is not None:
                yield pending
                pending = None
            for match in CODE_SPAN.finditer(line.text):
                yield line, match.group(2).strip()
    if pending is not None:
        yield pending


def segments(text: str) -> Iterator[list[str]]:
    """Simple commands of a shell line: split on ;, &&, || and |, comments dropped."""
    text = re.sub(r"^\$\s+", "", text)
    for part in re.split(r"&&|\|\||;|\|", text):
        try:
            tokens = shlex.split(part, comments=True)
        except ValueError:
            tokens = part.split()
            if "#" in [t[:1] for t in tokens]:
                tokens = tokens[:[t[:1] for t in tokens].index("#")]
        if tokens:
            yield tokens


def strip_prefix(tokens: list[str]) -> list[str]:
    """Drop leading VAR=value assignments, `env`, `time`, and an interpreter."""
    i = 0
    while i < len(tokens) and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[i]) or tokens[i] in ("env", "time")):
        i += 1
    rest = tokens[i:]
    if rest and INTERPRETERS.match(rest[0]):
        rest = rest[1:]
        if rest[:2] == ["-m", "distbuild"]:
            return ["distbuild", *rest[2:]]
    return rest


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*):", text, re.M))


def named_make_targets(tokens: list[str]) -> str | None:
    if not tokens or tokens[0] != "make":
        return None
    for token in tokens[1:]:
        if "=" in token or token.startswith("-"):
            continue
        return token
    return "help"   # a bare `make`: the Makefile's first target


@dataclass(frozen=True)
class Cli:
    argv: tuple[str, ...]          # what to run with --help
    label: str                     # how the failure names it


def project_cli(tokens: list[str]) -> tuple[Cli, list[str]] | None:
    """The project CLI a command line runs, and the arguments after it (subcommand included)."""
    if not tokens:
        return None
    head, rest = tokens[0], tokens[1:]
    if head == "distbuild":
        return Cli(("-m", "distbuild"), "python3 -m distbuild"), rest
    name = head[2:] if head.startswith("./") else head
    if name.startswith("scripts/") and name[len("scripts/"):] in SCRIPT_TOOLS:
        return Cli((name,), name), rest
    if name in ("configs/validate.py", "configs/deploy/render.py", "tests/flashinfer/gpu/run.py") \
            or re.match(r"^benchmarks/[a-z0-9_]+\.py$", name):
        return Cli((name,), name), rest
    return None


@lru_cache(maxsize=None)
def help_text(argv: tuple[str, ...]) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "build"), str(ROOT)]))
    done = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)} --help` exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return done.stdout


def subcommands(help_output: str) -> set[str]:
    match = re.search(r"\{([a-z0-9,-]+)\}", help_output)
    return set(match.group(1).split(",")) if match else set()


@dataclass(frozen=True)
class FlagUse:
    where: str
    cli: Cli
    sub: str | None
    flags: tuple[str, ...]


def flag_uses(path: Path) -> Iterator[FlagUse]:
    for line, text in command_texts(path):
        for tokens in segments(text):
            found = project_cli(strip_prefix(tokens))
            if found is None:
                continue
            cli, rest = found
            flags = []
            for token in rest:
                if token == "--":
                    break
                match = FLAG.match(token)
                if match:
                    flags.append(match.group(0))
            if not flags:
                continue   # nothing to check: its --help is not run
            first = rest[0] if rest and not rest[0].startswith("-") else None
            yield FlagUse(line.where(), cli, first, tuple(flags))


def make_problems(path: Path, targets: set[str]) -> list[str]:
    problems = []
    for line, text in command_texts(path):
        for tokens in segments(text):
            target = named_make_targets(strip_prefix(tokens))
            if target is not None and target not in targets:
                problems.append(f"{line.where()}: `make {target}`: no such target in the Makefile")
    return problems


def flag_problems(uses: list[FlagUse]) -> list[str]:
    # Every --help the docs need, run once each, side by side.
    wanted = {use.cli.argv for use in uses}
    with ThreadPoolExecutor(max_workers=4) as pool:
        tops = dict(zip(wanted, pool.map(_safe_help, wanted)))
    subs_wanted = set()
    for use in uses:
        top = tops[use.cli.argv]
        if isinstance(top, str) and use.sub in subcommands(top):
            subs_wanted.add((*use.cli.argv, use.sub))
    with ThreadPoolExecutor(max_workers=4) as pool:
        subs = dict(zip(subs_wanted, pool.map(_safe_help, subs_wanted)))
    problems = []
    for use in uses:
        top = tops[use.cli.argv]
        if isinstance(top, Exception):
            problems.append(f"{use.where}: {use.cli.label}: {top}")
            continue
        argv, label = use.cli.argv, use.cli.label
        if use.sub in subcommands(top):
            argv, label = (*argv, use.sub), f"{label} {use.sub}"
            top = subs[argv]
            if isinstance(top, Exception):
                problems.append(f"{use.where}: {label}: {top}")
                continue
        known = set(HELP_FLAG.findall(top))
        for flag in use.flags:
            if flag not in known and flag != "--help":
                problems.append(f"{use.where}: `{label} {flag}`: no such flag in `{label} --help`")
    return problems


def _safe_help(argv: tuple[str, ...]) -> str | Exception:
    try:
        return help_text(argv)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        return exc


# ---------------------------------------------------------------- tests

DOCS = doc_files()


def test_the_docs_are_found():
    names = {str(p.relative_to(ROOT)) for p in DOCS}
    assert {"README.md", "docs/building.md", "configs/README.md"} <= names, sorted(names)


def test_relative_links_resolve():
    problems = [p for path in DOCS for p in link_problems(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_make_targets_exist():
    targets = make_targets()
    problems = [p for path in DOCS for p in make_problems(path, targets)]
    assert not problems, "make targets the docs name but the Makefile lacks:\n" + "\n".join(problems)


def test_cli_flags_exist():
    uses = [use for path in DOCS for use in flag_uses(path)]
    assert uses, "no project command line found in the docs: the scan is broken"
    problems = flag_problems(uses)
    assert not problems, "flags the docs give a project CLI that its --help lacks:\n" + "\n".join(problems)


# The checker's own logic, on text written here.

def test_checker_catches_a_broken_link_a_missing_target_and_flag(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\nSee [x](missing.md) and [y](#title) and [z](#nowhere).\n\n"
                   "```sh\nmake no-such-target\nscripts/kv-sizing --no-such-flag --prompt-tokens 16Ki\n```\n"
                   "`make image STAGE=base`\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    links = link_problems(doc)
    assert len(links) == 2 and "doc.md:3: link target 'missing.md' does not exist" in links[0]
    assert "no heading '#nowhere'" in links[1]
    assert make_problems(doc, {"image"}) == ["doc.md:6: `make no-such-target`: no such target in the Makefile"]
    uses = list(flag_uses(doc))
    assert [u.flags for u in uses] == [("--no-such-flag", "--prompt-tokens")]


def test_checker_reads_shell_as_a_shell_does():
    assert strip_prefix(["PYTHONPATH=build", "python3", "-m", "distbuild", "test", "--no-peer"]) == \
        ["distbuild", "test", "--no-peer"]
    assert list(segments("cd x && make export UPSTREAM=lmcache   # regenerate")) == \
        [["cd", "x"], ["make", "export", "UPSTREAM=lmcache"]]
    assert named_make_targets(["make", "FORCE=1", "patched"]) == "patched"
    cli, rest = project_cli(["scripts/profile-capture", "command", "--out", "o", "--", "vllm", "--port", "1"])
    assert cli.label == "scripts/profile-capture" and rest[0] == "command"
    assert github_slug("The P/D router: vllm-router 0.1.17") == "the-pd-router-vllm-router-0117"
    assert github_slug("`make image` and friends") == "make-image-and-friends"


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_each_doc_is_utf8_text(path):
    path.read_text(encoding="utf-8")
