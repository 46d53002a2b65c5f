"""The leave-one-out variants (build/distbuild/host/leaveout.py) on a real git tree.

The tree is a pristine commit and one commit per patch, made with the build
tool's own git wrapper, as ``make patched`` makes them. Patch 3 edits lines
patch 1 adds, so it cannot apply without it; patch 2 changes a compiled
source and a Python file.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from distbuild.host import leaveout, testenv
from distbuild.errors import DistBuildError
from distbuild.gitrepo import PRISTINE_REF, Repo
from distbuild.series import series_entries

PATCHES = ["0001-adds-helper.patch", "0002-native-and-python.patch", "0003-uses-helper.patch"]


def write(root: Path, files: dict[str, str | None]) -> None:
    for name, text in files.items():
        path = root / name
        if text is None:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    repo = Repo(root)
    repo.init()
    write(root, {"lmcache/__init__.py": "", "lmcache/core.py": "A = 1\n", "csrc/op.cpp": "int op();\n",
                 "lmcache/old.py": "OLD = 1\n"})
    repo.set_ref(PRISTINE_REF, repo.commit_all("pristine"))
    write(root, {"lmcache/core.py": "A = 1\n\n\ndef helper():\n    return A\n"})
    repo.commit_all("adds helper")
    write(root, {"csrc/op.cpp": "int op() { return 2; }\n", "lmcache/native.py": "N = 2\n", "lmcache/old.py": None})
    repo.commit_all("native and python")
    write(root, {"lmcache/core.py": "A = 1\n\n\ndef helper():\n    return A + 1\n"})
    repo.commit_all("uses helper")
    return root


def test_a_patch_that_others_build_on_is_left_out_with_them(tree):
    variants = {v.patch: v for v in leaveout.left_out_variants(tree, PATCHES)}

    assert variants[PATCHES[0]].dependents == (PATCHES[2],)
    assert variants[PATCHES[1]].dependents == ()
    assert variants[PATCHES[2]].dependents == ()
    repo = Repo(tree)
    assert repo.git("show", f"{variants[PATCHES[0]].tree_hash}:lmcache/core.py").stdout == b"A = 1\n"
    # Without patch 3 only: patch 1's helper is there, unchanged.
    assert b"return A\n" in repo.git("show", f"{variants[PATCHES[2]].tree_hash}:lmcache/core.py").stdout


def test_changed_paths_say_whether_the_compiled_build_can_be_reused(tree):
    variants = {v.patch: v for v in leaveout.left_out_variants(tree, PATCHES)}

    assert set(variants[PATCHES[1]].changed) == {"csrc/op.cpp", "lmcache/native.py", "lmcache/old.py"}
    assert not variants[PATCHES[1]].python_only
    assert variants[PATCHES[2]].python_only


def _series(tmp_path: Path, *rules: str) -> Path:
    """A series folder: ``series`` lists PATCHES, ``leave-out`` holds ``rules``."""
    (tmp_path / "series").write_text("\n".join(PATCHES) + "\n")
    (tmp_path / leaveout.RULES_FILE).write_text("# which later patches build on a patch\n\n"
                                                + "".join(f"{rule}\n" for rule in rules))
    return tmp_path


def test_the_leave_out_file_must_declare_what_is_left_out_together(tree, tmp_path):
    rules = _series(tmp_path) / leaveout.RULES_FILE
    declared = leaveout.declared_dependents(tmp_path)
    problems = leaveout.check_declarations(leaveout.left_out_variants(tree, PATCHES, declared), declared, rules)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{rules}: without {PATCHES[0]}, {PATCHES[2]} does not apply")
    assert f"write '{PATCHES[0]} with {PATCHES[2]}: <why>'" in problems[0]

    _series(tmp_path, f"{PATCHES[0]} with {PATCHES[2]}: 0003 edits the helper 0001 adds")
    declared = leaveout.declared_dependents(tmp_path)
    variants = leaveout.left_out_variants(tree, PATCHES, declared)
    assert leaveout.check_declarations(variants, declared, rules) == []
    assert variants[0].undeclared == ()


def test_a_declared_dependent_is_left_out_even_when_it_applies(tree, tmp_path):
    rules = _series(tmp_path, f"{PATCHES[0]} with {PATCHES[2]}: 0003 edits the helper 0001 adds",
                    f"{PATCHES[1]} with {PATCHES[2]}: 0003 uses what 0002 adds at run time") / leaveout.RULES_FILE
    declared = leaveout.declared_dependents(tmp_path)
    variants = {v.patch: v for v in leaveout.left_out_variants(tree, PATCHES, declared)}

    assert variants[PATCHES[1]].dependents == (PATCHES[2],)
    assert leaveout.check_declarations(list(variants.values()), declared, rules) == []
    core = Repo(tree).git("show", f"{variants[PATCHES[1]].tree_hash}:lmcache/core.py").stdout
    assert b"return A\n" in core  # 0003's edit is not there


def test_a_declaration_must_name_a_later_patch(tree, tmp_path):
    rules = _series(tmp_path, f"{PATCHES[2]} with {PATCHES[0]}: backwards",
                    f"{PATCHES[0]} with {PATCHES[2]}: ok") / leaveout.RULES_FILE
    declared = leaveout.declared_dependents(tmp_path)
    problems = leaveout.check_declarations(leaveout.left_out_variants(tree, PATCHES, declared), declared, rules)
    assert problems == [f"{rules}: leave-out of {PATCHES[2]} names {PATCHES[0]}, which is not a later patch"]


def test_a_rule_that_does_not_parse_names_its_file_and_line(tmp_path):
    rules = _series(tmp_path, f"{PATCHES[0]} with {PATCHES[2]}: ok", f"{PATCHES[1]} {PATCHES[2]}") / leaveout.RULES_FILE
    with pytest.raises(DistBuildError, match=f"{rules}:4: not '<patch> with"):
        leaveout.declared_dependents(tmp_path)


def test_a_rule_left_in_the_series_file_is_refused(tmp_path):
    _series(tmp_path)
    (tmp_path / "series").write_text(f"# leave-out: {PATCHES[0]} with {PATCHES[2]}: old place\n"
                                     + "\n".join(PATCHES) + "\n")
    with pytest.raises(DistBuildError, match=r"series:1: a leave-out rule belongs in .*leave-out"):
        leaveout.declared_dependents(tmp_path)


def test_the_project_series_declares_every_dependent_in_its_own_file():
    series_dir = Path(__file__).resolve().parents[2] / "patches" / "lmcache"
    declared = leaveout.declared_dependents(series_dir)
    listed = set(series_entries(series_dir / "series"))
    assert declared and set(declared) <= listed
    assert all(names <= listed and why for names, why in declared.values())


def test_commits_must_match_the_series(tree):
    with pytest.raises(Exception, match="2 patches"):
        leaveout.left_out_variants(tree, PATCHES[:2])


def test_overlay_site_puts_the_variant_python_over_the_installed_package(tree, tmp_path):
    variants = {v.patch: v for v in leaveout.left_out_variants(tree, PATCHES)}
    installed = tmp_path / "site-packages" / "lmcache"
    write(installed, {"__init__.py": "", "core.py": "patched\n", "native.py": "N = 2\n",
                      "lmcache_native.so": "compiled\n"})

    site = leaveout.overlay_site(Repo(tree), variants[PATCHES[2]].tree_hash, Repo(tree).tree("HEAD"), installed,
                                 tmp_path / "v3")

    assert (site / "lmcache" / "core.py").read_text() == "A = 1\n\n\ndef helper():\n    return A\n"
    assert (site / "lmcache" / "lmcache_native.so").read_text() == "compiled\n"
    assert not (tmp_path / "v3.partial").exists()
    # The site names its own tree, not the installed build's (a test reading the build's sources reads it).
    assert (site / testenv.STAMP).read_text() == variants[PATCHES[2]].tree_hash


def test_a_wheel_is_reused_by_a_variant_whose_compiled_content_is_the_same(tree, tmp_path):
    repo = Repo(tree)
    wheels = tmp_path / "wheels"
    without_2 = {v.patch: v for v in leaveout.left_out_variants(tree, PATCHES)}[PATCHES[1]].tree_hash
    assert leaveout.built_with_same_compiled_content(wheels, repo, without_2) is None
    (wheels / f"lmcache-{without_2}").mkdir(parents=True)
    (wheels / f"lmcache-{without_2}" / "lmcache-0.5.5-cp311-linux_x86_64.whl").write_text("wheel")
    leaveout.record_compiled_content(wheels, repo, without_2)

    # The series edited in Python only (patch 3 changes core.py again): the same compiled content.
    write(tree, {"lmcache/core.py": "A = 1\n\n\ndef helper():\n    return A + 3\n"})
    repo.commit_all("python only")
    edited = {v.patch: v for v in leaveout.left_out_variants(tree, [*PATCHES, "0004-python-only.patch"])}
    edited_without_2 = edited[PATCHES[1]].tree_hash
    assert edited_without_2 != without_2
    same = leaveout.built_with_same_compiled_content(wheels, repo, edited_without_2)
    assert same is not None and same.tree == without_2
    assert set(same.python_files) == {"lmcache/__init__.py", "lmcache/core.py", "lmcache/old.py"}

    # Its site: the build's package with the variant's Python files (the build's own ones out,
    # a file the build generated kept).
    installed = tmp_path / "built" / "lmcache"
    write(installed, {"__init__.py": "", "core.py": "built\n", "old.py": "built\n", "gone.py": "",
                      "_version.py": "v\n", "op.so": "compiled\n"})
    same = leaveout.CompiledBuild(same.tree, (*same.python_files, "lmcache/gone.py"))
    site = leaveout.python_site(repo, edited_without_2, same, installed, tmp_path / "site") / "lmcache"
    assert (site / "core.py").read_text() == "A = 1\n\n\ndef helper():\n    return A + 3\n"
    assert (site / "old.py").read_text() == "OLD = 1\n"  # the variant's, not the build's
    assert not (site / "native.py").exists() and not (site / "gone.py").exists()
    assert (site / "_version.py").read_text() == "v\n" and (site / "op.so").read_text() == "compiled\n"
    # The stamp names the variant's tree, whose headers a C++ proof reads, not the reused build's.
    assert (site.parent / testenv.STAMP).read_text() == edited_without_2

    # A variant whose compiled source differs (the series without patch 4 has patch 5's op.cpp): a build of its own.
    write(tree, {"csrc/op.cpp": "int op() { return 3; }\n"})
    repo.commit_all("native")
    native = leaveout.left_out_variants(tree, [*PATCHES, "0004-python-only.patch", "0005-native.patch"])
    assert leaveout.built_with_same_compiled_content(wheels, repo, native[3].tree_hash) is None
    # An index entry whose wheel is gone is no match.
    (wheels / f"lmcache-{without_2}" / "lmcache-0.5.5-cp311-linux_x86_64.whl").unlink()
    assert leaveout.built_with_same_compiled_content(wheels, repo, edited_without_2) is None


def test_overlay_site_removes_files_the_variant_lacks(tree, tmp_path):
    repo = Repo(tree)
    installed = tmp_path / "pkg" / "lmcache"
    write(installed, {"__init__.py": "", "core.py": "patched\n", "native.py": "N = 2\n"})

    # A variant that differs from the installed build in csrc/ needs its own build.
    with pytest.raises(Exception, match="non-Python files.*csrc/op.cpp"):
        leaveout.overlay_site(repo, repo.tree("HEAD~2"), repo.tree("HEAD"), installed, tmp_path / "site")
    assert not (tmp_path / "site").exists()

    # Python only: the tree after 0002 seen from the build of the tree after 0003.
    site = leaveout.overlay_site(repo, repo.tree("HEAD~1"), repo.tree("HEAD"), installed, tmp_path / "site")
    assert (site / "lmcache" / "core.py").read_text() == "A = 1\n\n\ndef helper():\n    return A\n"
    assert (site / "lmcache" / "native.py").read_text() == "N = 2\n"

    # Files the variant lacks are removed: the pristine tree's Python seen from
    # the build after 0002 (with its C++ undone by hand, as a wheel would be).
    fake = tmp_path / "fake"
    fake_repo = Repo(fake)
    fake_repo.init()
    write(fake, {"lmcache/__init__.py": "", "lmcache/core.py": "A = 1\n", "lmcache/native.py": "N = 2\n"})
    with_native = fake_repo.tree(fake_repo.commit_all("with native"))
    write(fake, {"lmcache/native.py": None})
    without_native = fake_repo.tree(fake_repo.commit_all("without native"))
    site = leaveout.overlay_site(fake_repo, without_native, with_native, installed, tmp_path / "site2")
    assert not (site / "lmcache" / "native.py").exists()
    assert (site / "lmcache" / "core.py").read_text() == "patched\n"  # unchanged between the trees: the build's


def part_diff(tree: Path, tmp_path: Path, name: str, path: str, old: str, new: str, rev: str) -> Path:
    """A diff from ``old`` to ``new`` of ``path`` (``old`` as at ``rev``), with a leading note, as a part file."""
    repo = Repo(tree)
    assert repo.git("show", f"{rev}:{path}").stdout.decode() == old
    (tmp_path / "a" / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "b" / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "a" / path).write_text(old)
    (tmp_path / "b" / path).write_text(new)
    # run in tmp_path, without prefixes: the paths read a/<path> and b/<path>, as git apply wants them
    body = Repo(tmp_path).git("diff", "--no-index", "--src-prefix=", "--dst-prefix=", f"a/{path}", f"b/{path}",
                              check=False).stdout.decode()
    parts = tmp_path / "parts"
    parts.mkdir(exist_ok=True)
    out = parts / name
    out.write_text(f"What this part removes, and why.\n\n{body}")
    return out


def test_a_part_variant_is_the_series_with_that_part_of_one_patch_removed(tree, tmp_path):
    # Patch 2's Python half, N = 2, is the part; patch 3 still applies after it.
    part_diff(tree, tmp_path, "0002-native-and-python.python.diff", "lmcache/native.py",
                          "N = 2\n", "N = 0\n", "HEAD~1")
    parts = leaveout.series_parts(tmp_path / "parts", PATCHES)
    assert [(p.patch, p.name, p.variant) for p in parts] == [
        (PATCHES[1], "python", f"{PATCHES[1]}:python")]

    [variant] = leaveout.part_variants(tree, PATCHES, parts)

    repo = Repo(tree)
    assert (variant.name, variant.stem, variant.part) == (f"{PATCHES[1]}:python", "0002-native-and-python.python",
                                                          "python")
    assert variant.changed == ("lmcache/native.py",) and variant.python_only
    assert variant.dependents == () and variant.undeclared == ()
    assert repo.git("show", f"{variant.tree_hash}:lmcache/native.py").stdout == b"N = 0\n"
    # the rest of patch 2 (its C++) and patch 3 (the later edit) are there
    assert repo.git("show", f"{variant.tree_hash}:csrc/op.cpp").stdout == b"int op() { return 2; }\n"
    assert b"return A + 1\n" in repo.git("show", f"{variant.tree_hash}:lmcache/core.py").stdout
    assert leaveout.check_declarations([variant], {}, tmp_path / "series") == []


def test_a_part_that_a_later_patch_edits_over_is_a_problem(tree, tmp_path):
    # Patch 1's helper is the part; patch 3 edits the line it removes.
    part_diff(tree, tmp_path, "0001-adds-helper.helper.diff", "lmcache/core.py",
              "A = 1\n\n\ndef helper():\n    return A\n", "A = 1\n\n\ndef helper():\n    return None\n", "HEAD~2")
    [variant] = leaveout.part_variants(tree, PATCHES, leaveout.series_parts(tmp_path / "parts", PATCHES))

    assert variant.undeclared == (PATCHES[2],)
    assert leaveout.check_declarations([variant], {}, tmp_path / "series") == [
        f"{tmp_path / 'series'}: without the helper part of {PATCHES[0]}, {PATCHES[2]} does not apply: "
        "a part must remove only what its patch adds and later patches do not edit"]


def test_a_part_must_undo_something_its_patch_adds(tree, tmp_path):
    # A diff of a line the pristine tree has already applies before patch 2: it removes nothing of patch 2's.
    part_diff(tree, tmp_path, "0002-native-and-python.core.diff", "lmcache/core.py",
              "A = 1\n\n\ndef helper():\n    return A\n", "A = 2\n\n\ndef helper():\n    return A\n", "HEAD~1")
    with pytest.raises(Exception, match="applies on the tree before the patch"):
        leaveout.part_variants(tree, PATCHES, leaveout.series_parts(tmp_path / "parts", PATCHES))


def test_a_part_file_must_name_a_patch_of_the_series_and_a_part(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "0009-not-in-series.x.diff").write_text("")
    with pytest.raises(Exception, match="a part is <patch stem>.<part>.diff"):
        leaveout.series_parts(parts, PATCHES)
    (parts / "0009-not-in-series.x.diff").unlink()
    (parts / "0001-adds-helper.diff").write_text("")
    with pytest.raises(Exception, match="a part is <patch stem>.<part>.diff"):
        leaveout.series_parts(parts, PATCHES)
    assert leaveout.series_parts(tmp_path / "absent", PATCHES) == []
