"""Leave-one-out variants of a patch series: the series without patch N.

A proof of patch N that fails on the pristine tree may fail only because a
module or keyword a *later* patch relies on is missing there (an ImportError
proves nothing about N's behaviour). The honest test of N's proof is the
series with only N left out: every other patch applied, so the proof fails
for N's reason or not at all.

A variant's tree is made without a work tree: the commit before N is read
into a temporary index and the diff of every later commit is applied to that
index with ``git apply --cached`` (exact context, no fuzz, as the series is
applied). A later patch that builds on N is left out with it; the series
file says which, with the reason, on a line

    # leave-out: <patch file> with <later patch file>[, ...]: <why>

A later patch that applies without N may still need it to run (it uses an
attribute N adds): declaring it leaves it out too. A later patch that does
not apply without N and is not declared is an error, so the series file
stays true; so is a declaration that names a patch that is not later in the
series.

Most patches change only Python files. Their variant reuses the patched
build's compiled package: a copy of the installed ``lmcache`` package with
the files the variant tree has differently put over it, first on
``PYTHONPATH``. A variant that differs in anything else (C++ sources, build
files) gets a wheel of its own, built like the others and cached by tree hash.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import DistBuildError
from .gitrepo import PRISTINE_REF, Repo, git_env

LEAVE_OUT = re.compile(r"^#\s*leave-out:\s*(?P<patch>\S+)\s+with\s+(?P<with>[^:]+):\s*(?P<why>\S.*)$")
PACKAGE = "lmcache"


@dataclass(frozen=True)
class LeftOut:
    patch: str                # the patch file left out
    tree_hash: str            # the variant's tree
    dependents: tuple[str, ...]  # later patches left out with it (declared or not applying)
    changed: tuple[str, ...]  # paths the variant has differently from the patched tree
    undeclared: tuple[str, ...] = ()  # dependents that did not apply and are not declared

    @property
    def python_only(self) -> bool:
        return all(path.endswith(".py") for path in self.changed)


def declared_dependents(series_file: Path) -> dict[str, tuple[set[str], str]]:
    """``leave-out`` lines of a series file: patch -> (patches left out with it, why)."""
    declared: dict[str, tuple[set[str], str]] = {}
    for number, line in enumerate(series_file.read_text().splitlines(), start=1):
        match = LEAVE_OUT.match(line.strip())
        if match:
            if match["patch"] in declared:
                raise DistBuildError(f"{series_file}:{number}: leave-out of {match['patch']} is declared twice")
            names = {name.strip() for name in match["with"].split(",") if name.strip()}
            declared[match["patch"]] = (names, match["why"])
    return declared


def series_commits(repo: Repo, patches: list[str]) -> list[str]:
    """The commit of each patch in the prepared tree (one commit per patch, in order)."""
    commits = repo.out("rev-list", "--reverse", f"{PRISTINE_REF}..HEAD").split()
    if len(commits) != len(patches):
        raise DistBuildError(
            f"{repo.path}: {len(commits)} commits on top of the pristine tree for a series of "
            f"{len(patches)} patches; run `make patched` (or `make export`) first"
        )
    return commits


def variant_tree(repo: Repo, commits: list[str], index: int, declared: set[int]) -> tuple[str, list[int]]:
    """The tree of the series without commit ``index``, the ``declared`` later
    commits, and the later commits that do not apply without them."""
    dropped: list[int] = []
    with tempfile.TemporaryDirectory(prefix="dist-leaveout-") as tmp:
        env = dict(git_env(), GIT_INDEX_FILE=str(Path(tmp) / "index"))
        repo.git("read-tree", f"{commits[index]}^", env=env)
        for later in range(index + 1, len(commits)):
            if later in declared:
                dropped.append(later)
                continue
            diff = repo.git("diff", "--binary", "--full-index", f"{commits[later]}^", commits[later]).stdout
            applied = repo.git("apply", "--cached", "--whitespace=nowarn", "-", input=diff, env=env, check=False)
            if applied.returncode != 0:
                dropped.append(later)
        return repo.git("write-tree", env=env).stdout.decode().strip(), dropped


def left_out_variants(tree: Path, patches: list[str],
                      declared: dict[str, tuple[set[str], str]] | None = None) -> list[LeftOut]:
    """One variant per patch of the series, in series order."""
    declared = declared or {}
    repo = Repo(tree)
    commits = series_commits(repo, patches)
    head = repo.tree("HEAD")
    position = {name: i for i, name in enumerate(patches)}
    out: list[LeftOut] = []
    for index, patch in enumerate(patches):
        names = declared.get(patch, (set(), ""))[0]
        wanted = {position[name] for name in names if position.get(name, -1) > index}
        tree_hash, dropped = variant_tree(repo, commits, index, wanted)
        changed = tuple(repo.out("diff", "--name-only", head, tree_hash).splitlines())
        out.append(LeftOut(patch, tree_hash, tuple(patches[i] for i in dropped), changed,
                           tuple(patches[i] for i in dropped if i not in wanted)))
    return out


def check_declarations(variants: list[LeftOut], declared: dict[str, tuple[set[str], str]],
                       series_file: Path) -> list[str]:
    """Problems: a later patch that does not apply and is not declared; a
    declaration naming a patch that is not later in the series."""
    problems: list[str] = []
    order = [v.patch for v in variants]
    for patch, (names, _) in sorted(declared.items()):
        if patch not in order:
            problems.append(f"{series_file}: leave-out names {patch}, which the series does not list")
            continue
        for name in sorted(names):
            if name not in order or order.index(name) <= order.index(patch):
                problems.append(f"{series_file}: leave-out of {patch} names {name}, which is not a later patch")
    for variant in variants:
        if variant.undeclared:
            wanted = sorted({*declared.get(variant.patch, (set(), ""))[0], *variant.undeclared})
            problems.append(
                f"{series_file}: without {variant.patch}, {', '.join(variant.undeclared)} "
                f"{'do' if len(variant.undeclared) != 1 else 'does'} not apply and the series does not say so: "
                f"write '# leave-out: {variant.patch} with {', '.join(wanted)}: <why>'"
            )
    return problems


def changed_paths(repo: Repo, base_tree: str, tree_hash: str) -> tuple[str, ...]:
    return tuple(repo.out("diff", "--name-only", base_tree, tree_hash).splitlines())


def overlay_site(repo: Repo, tree_hash: str, base_tree: str, installed: Path, dest: Path) -> Path:
    """A site folder with the installed package and the variant's Python files over it.

    ``installed`` is an installed build's package folder
    (``site-packages/lmcache``) of the tree ``base_tree``; the files the
    variant ``tree_hash`` has differently must all be Python files.
    """
    changed = changed_paths(repo, base_tree, tree_hash)
    compiled = [path for path in changed if not path.endswith(".py")]
    if compiled:
        raise DistBuildError(f"variant {tree_hash[:12]} differs from the installed build in non-Python files "
                             f"({', '.join(compiled[:3])}): it needs a build of its own")
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(installed, staging / PACKAGE, symlinks=True)
    for path in changed:
        if not path.startswith(f"{PACKAGE}/"):
            continue  # tests/, docs: not part of the installed package
        target = staging / path
        blob = repo.git("cat-file", "-e", f"{tree_hash}:{path}", check=False)
        if blob.returncode != 0:
            target.unlink(missing_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(repo.git("show", f"{tree_hash}:{path}").stdout)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(staging, dest)
    return dest
