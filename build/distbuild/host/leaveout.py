"""Leave-one-out variants of a patch series: the series without patch N.

A proof of patch N that fails on the pristine tree may fail only because a
module or keyword a *later* patch relies on is missing there (an ImportError
proves nothing about N's behaviour). The honest test of N's proof is the
series with only N left out: every other patch applied, so the proof fails
for N's reason or not at all.

A variant's tree is made without a work tree: the commit before N is read
into a temporary index and the diff of every later commit is applied to that
index with ``git apply --cached`` (exact context, no fuzz, as the series is
applied). A later patch that builds on N is left out with it; the file
``leave-out`` beside ``series`` says which, with the reason, one line each

    <patch file> with <later patch file>[, ...]: <why>

A later patch that applies without N may still need it to run (it uses an
attribute N adds): declaring it leaves it out too. A later patch that does
not apply without N and is not declared is an error, so the file stays true;
so is a declaration that names a patch that is not later in the series.

A proof may state a property of one part of patch N (the stream a load
runs on, say) that the series without all of N cannot isolate: there the
feature is missing and the proof fails before it reaches that property. Such
a part is a diff, ``<parts dir>/<patch stem>.<part>.diff``, that applies on
the tree after N and removes that part only (its leading text says what and
why; the project keeps them in ``tests/parts/lmcache/``). Its variant is the
series with N replaced by N less the part: the commit of N, the part's diff,
then every later commit; a later commit that does not apply is an error (a
part removes what N adds, not what a later patch needs), and so is a diff
that applies on the tree before N as well (it would not undo anything of N's).
The variant is named ``<patch file>:<part>``.

Most patches change only Python files. Their variant reuses the patched
build's compiled package: a copy of the installed ``lmcache`` package with
the files the variant tree has differently put over it, first on
``PYTHONPATH``. A variant that differs in anything else (C++ sources, build
files) gets a wheel of its own, built like the others and cached by tree hash.
That wheel is indexed by the variant's files other than Python (its compiled
content): a later variant with the same compiled content, after a series
edit that changed only Python files, installs it and gets its own Python
files put over it, instead of building again.

Every site folder names its variant's tree in a stamp beside the package
(``dist-lmcache-tree``, as an installed build does), so a test that reads the
sources of the build under test (the C++ headers, say) reads the variant's
and not the patched build's that the venv's stamp names.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import testenv
from ..errors import DistBuildError
from ..gitrepo import PRISTINE_REF, Repo, git_env
from .testenv import STAMP as TREE_STAMP

RULES_FILE = "leave-out"
RULE = re.compile(r"^(?P<patch>\S+)\s+with\s+(?P<with>[^:]+):\s*(?P<why>\S.*)$")
# Where the rules lived before they had a file of their own: such a line in `series` is refused.
SERIES_RULE = re.compile(r"^#\s*leave-out:")
PACKAGE = "lmcache"
PART_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
PART_SUFFIX = ".diff"


@dataclass(frozen=True)
class LeftOut:
    patch: str                # the patch file left out (or, with ``part``, the patch that part is of)
    tree_hash: str            # the variant's tree
    dependents: tuple[str, ...]  # later patches left out with it (declared or not applying)
    changed: tuple[str, ...]  # paths the variant has differently from the patched tree
    undeclared: tuple[str, ...] = ()  # dependents that did not apply and are not declared
    part: str | None = None   # only this part of ``patch`` is left out (see Part)

    @property
    def python_only(self) -> bool:
        return all(path.endswith(".py") for path in self.changed)

    @property
    def name(self) -> str:
        """What ``DIST_LMCACHE_TREE=without:<name>`` and the proof map call the variant."""
        return variant_name(self.patch, self.part)

    @property
    def stem(self) -> str:
        """A file name for the variant's logs and site folder."""
        stem = Path(self.patch).stem
        return f"{stem}.{self.part}" if self.part else stem


def variant_name(patch: str, part: str | None) -> str:
    return f"{patch}:{part}" if part else patch


@dataclass(frozen=True)
class Part:
    """A part of one patch that a leave-one-out variant removes alone."""
    patch: str   # the patch file the part is of
    name: str    # the part's name, as proofs' ``part=`` give it
    path: Path   # the diff that removes it, applied on the tree after ``patch``

    @property
    def variant(self) -> str:
        return variant_name(self.patch, self.name)


def series_parts(parts_dir: Path, patches: list[str]) -> list[Part]:
    """The parts in ``parts_dir``, in series order; a file that names no patch
    of the series, or whose part name is not [a-z0-9-], is an error."""
    if not parts_dir.is_dir():
        return []
    by_stem = {Path(patch).stem: patch for patch in patches}
    parts: list[Part] = []
    for path in sorted(parts_dir.iterdir()):
        if not path.is_file():
            continue
        stem, dot, name = path.name.removesuffix(PART_SUFFIX).rpartition(".")
        if not path.name.endswith(PART_SUFFIX) or not dot or stem not in by_stem or not PART_NAME.match(name):
            raise DistBuildError(f"{path}: a part is <patch stem>.<part>{PART_SUFFIX}, for a patch of the series "
                                 f"and a part name of [a-z0-9-]")
        parts.append(Part(by_stem[stem], name, path))
    order = {patch: i for i, patch in enumerate(patches)}
    return sorted(parts, key=lambda part: (order[part.patch], part.name))


def declared_dependents(directory: Path) -> dict[str, tuple[set[str], str]]:
    """The ``leave-out`` file of a series folder: patch -> (patches left out with it, why).
    An absent file declares nothing."""
    rules_file = directory / RULES_FILE
    series_file = directory / "series"
    if series_file.is_file():
        for number, line in enumerate(series_file.read_text().splitlines(), start=1):
            if SERIES_RULE.match(line.strip()):
                raise DistBuildError(f"{series_file}:{number}: a leave-out rule belongs in {rules_file}, "
                                     "as '<patch> with <later patch>[, ...]: <why>'")
    declared: dict[str, tuple[set[str], str]] = {}
    if not rules_file.is_file():
        return declared
    for number, line in enumerate(rules_file.read_text().splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        match = RULE.match(text)
        if match is None:
            raise DistBuildError(f"{rules_file}:{number}: not '<patch> with <later patch>[, ...]: <why>': {text[:80]}")
        if match["patch"] in declared:
            raise DistBuildError(f"{rules_file}:{number}: leave-out of {match['patch']} is declared twice")
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


def variant_tree(repo: Repo, commits: list[str], index: int, declared: set[int],
                 part: Path | None = None) -> tuple[str, list[int]]:
    """The tree of the series without commit ``index``, the ``declared`` later
    commits, and the later commits that do not apply without them.

    With ``part`` (a diff), commit ``index`` stays and loses only what that
    diff removes: it must apply on the tree after the commit and not on the
    tree before it."""
    dropped: list[int] = []
    with tempfile.TemporaryDirectory(prefix="dist-leaveout-") as tmp:
        env = dict(git_env(), GIT_INDEX_FILE=str(Path(tmp) / "index"))
        repo.git("read-tree", f"{commits[index]}^", env=env)
        if part is not None:
            diff = part.read_bytes()
            if repo.git("apply", "--cached", "--check", "-", input=diff, env=env, check=False).returncode == 0:
                raise DistBuildError(f"{part}: applies on the tree before the patch it is a part of as well, "
                                     "so it removes nothing that patch adds")
            repo.git("read-tree", commits[index], env=env)
            applied = repo.git("apply", "--cached", "--whitespace=nowarn", "-", input=diff, env=env, check=False)
            if applied.returncode != 0:
                raise DistBuildError(f"{part}: does not apply on the tree after the patch it is a part of: "
                                     f"{applied.stderr.decode(errors='replace').strip()}")
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


def part_variants(tree: Path, patches: list[str], parts: list[Part]) -> list[LeftOut]:
    """One variant per part: the series with the part's patch less that part.
    A later patch that does not apply there is in the variant's ``undeclared``
    (check_declarations names it); a part cannot leave later patches out."""
    repo = Repo(tree)
    commits = series_commits(repo, patches)
    head = repo.tree("HEAD")
    out: list[LeftOut] = []
    for part in parts:
        tree_hash, dropped = variant_tree(repo, commits, patches.index(part.patch), set(), part.path)
        changed = tuple(repo.out("diff", "--name-only", head, tree_hash).splitlines())
        names = tuple(patches[i] for i in dropped)
        out.append(LeftOut(part.patch, tree_hash, names, changed, names, part=part.name))
    return out


def check_declarations(variants: list[LeftOut], declared: dict[str, tuple[set[str], str]],
                       rules_file: Path) -> list[str]:
    """Problems: a later patch that does not apply and is not declared; a
    declaration naming a patch that is not later in the series."""
    problems: list[str] = []
    order = [v.patch for v in variants if v.part is None]
    for patch, (names, _) in sorted(declared.items()):
        if patch not in order:
            problems.append(f"{rules_file}: leave-out names {patch}, which the series does not list")
            continue
        for name in sorted(names):
            if name not in order or order.index(name) <= order.index(patch):
                problems.append(f"{rules_file}: leave-out of {patch} names {name}, which is not a later patch")
    for variant in variants:
        if variant.undeclared and variant.part is not None:
            problems.append(
                f"{rules_file}: without the {variant.part} part of {variant.patch}, "
                f"{', '.join(variant.undeclared)} {'do' if len(variant.undeclared) != 1 else 'does'} not apply: "
                "a part must remove only what its patch adds and later patches do not edit"
            )
        elif variant.undeclared:
            wanted = sorted({*declared.get(variant.patch, (set(), ""))[0], *variant.undeclared})
            problems.append(
                f"{rules_file}: without {variant.patch}, {', '.join(variant.undeclared)} "
                f"{'do' if len(variant.undeclared) != 1 else 'does'} not apply and the series does not say so: "
                f"write '{variant.patch} with {', '.join(wanted)}: <why>'"
            )
    return problems


COMPILED_INDEX = "compiled"


NOT_BUILT = ("tests/", "docs/")


def compiled_key(repo: Repo, tree_hash: str) -> str:
    """A digest of the tree's files but its Python files, tests and docs: what a wheel's compiled part is
    built from."""
    listing = repo.out("ls-tree", "-r", "--full-tree", tree_hash).splitlines()
    kept = "\n".join(line for line in listing
                     if not line.endswith(".py") and not line.split("\t", 1)[1].startswith(NOT_BUILT))
    return hashlib.sha256(kept.encode()).hexdigest()


@dataclass(frozen=True)
class CompiledBuild:
    """A cached wheel: the tree it was built from and that tree's Python files of the package."""
    tree: str
    python_files: tuple[str, ...]


def _package_python_files(repo: Repo, tree_hash: str) -> list[str]:
    listing = repo.out("ls-tree", "-r", "--name-only", "--full-tree", tree_hash, "--", f"{PACKAGE}/")
    return [path for path in listing.splitlines() if path.endswith(".py")]


def built_with_same_compiled_content(wheels: Path, repo: Repo, tree_hash: str) -> CompiledBuild | None:
    """A cached wheel built from the same non-Python files as ``tree_hash``, if there is one. The index
    names the tree and lists its Python files, so it serves a clone that does not hold that tree."""
    entry = wheels / COMPILED_INDEX / compiled_key(repo, tree_hash)
    if not entry.is_file():
        return None
    built, *python_files = entry.read_text().split()
    if not python_files or not any((wheels / f"lmcache-{built}").glob("*.whl")):
        return None
    return CompiledBuild(built, tuple(python_files))


def record_compiled_content(wheels: Path, repo: Repo, tree_hash: str) -> None:
    """Index the cached wheel of ``tree_hash`` by its compiled content."""
    index = wheels / COMPILED_INDEX
    index.mkdir(parents=True, exist_ok=True)
    entry = index / compiled_key(repo, tree_hash)
    partial = entry.with_suffix(".partial")
    partial.write_text("\n".join([tree_hash, *_package_python_files(repo, tree_hash)]) + "\n")
    os.replace(partial, entry)


def python_site(repo: Repo, tree_hash: str, build: CompiledBuild, installed: Path, dest: Path) -> Path:
    """A site folder with the installed package of ``build`` and every Python file of the package
    as ``tree_hash`` has it: the build's own Python files out, the variant's in (files the build
    generated, such as its version file, stay)."""
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(installed, staging / PACKAGE, symlinks=True)
    for path in build.python_files:
        (staging / path).unlink(missing_ok=True)
    for path in _package_python_files(repo, tree_hash):
        target = staging / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(repo.git("show", f"{tree_hash}:{path}").stdout)
    return _publish(staging, tree_hash, dest)


def _publish(staging: Path, tree_hash: str, dest: Path) -> Path:
    """Stamp the staged site with the tree it holds and move it into place."""
    (staging / TREE_STAMP).write_text(tree_hash)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(staging, dest)
    return dest


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
    return _publish(staging, tree_hash, dest)


def site_builder(tree: Path, venv: Path, python: Path, version: str, wheels: Path, sites: Path,
                 logs: Path) -> Callable[[LeftOut], Path]:
    """Builds the site folder of one variant of ``tree`` under ``sites``: the variant's Python files over
    the build installed in ``venv`` when only Python files differ, else a wheel of its own (or one with
    the same compiled content, its Python files put over it)."""
    repo = Repo(tree)
    installed = next((venv / "lib").glob(f"python3*/site-packages/{PACKAGE}"), None)
    stamp = venv / TREE_STAMP
    if installed is None or not stamp.is_file():
        raise DistBuildError(f"{venv}: the patched LMCache build is not installed")
    installed_tree = stamp.read_text().strip()

    def build(variant: LeftOut) -> Path:
        dest = sites / variant.stem
        if all(path.endswith(".py") for path in changed_paths(repo, installed_tree, variant.tree_hash)):
            return overlay_site(repo, variant.tree_hash, installed_tree, installed, dest)
        number = variant.patch.split("-", 1)[0] + (f".{variant.part.replace('-', '.')}" if variant.part else "")
        same = built_with_same_compiled_content(wheels, repo, variant.tree_hash)
        if same is not None:
            # Only Python files differ from a wheel already built: install it, put the variant's over it.
            compiled = dest.with_name(dest.name + ".compiled")
            testenv.install(testenv.Variant(f"without-{number}", venv, tree, same.tree, version, compiled),
                            python, wheels, logs)
            print(f"without-{number} reuses the build of tree {same.tree[:12]} (same compiled content)", flush=True)
            return python_site(repo, variant.tree_hash, same, compiled / PACKAGE, dest)
        built = testenv.Variant(f"without-{number}", venv, tree, variant.tree_hash,
                                f"{version}+dist.without.{number}", dest)
        testenv.install(built, python, wheels, logs)
        record_compiled_content(wheels, repo, variant.tree_hash)
        return dest

    return build
