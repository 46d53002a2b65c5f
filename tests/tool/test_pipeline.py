"""The build tool end to end on a throwaway upstream: reproducibility, the
patch pipeline, export, health and the manifest."""
from __future__ import annotations

import json
import subprocess

from distbuild.gitrepo import Repo
from distbuild.series import series_entries

from .conftest import BASE_FILES, patch_text

P1 = ("0001-return-fifty.patch",
      patch_text("[Bugfix] f5 returns fifty", "demo/core.py", "    return 5", "    return 50", ["def f5():"], 16))
P2 = ("0002-return-ninety.patch",
      patch_text("[Feature] f30 returns ninety", "demo/core.py", "    return 30", "    return 90", ["def f30():"], 91))


def trees(out: str) -> list[str]:
    return [line.split()[-1] for line in out.splitlines() if " tree " in line]


def test_two_clean_runs_give_identical_hashes(demo, tmp_path, capsys):
    demo.series(P1, P2)
    assert demo.run("patched") == 0
    first = capsys.readouterr().out
    head_first = Repo(demo.work / "src" / "demo").head()
    manifest_first = (demo.work / "manifest.json").read_bytes()

    demo.work = tmp_path / "second-work"
    assert demo.run("patched") == 0
    second = capsys.readouterr().out
    assert trees(first) == trees(second) and len(trees(first)) == 2
    assert trees(first)[0] != trees(first)[1], "the patched tree must differ from the pristine one"
    assert Repo(demo.work / "src" / "demo").head() == head_first
    assert (demo.work / "manifest.json").read_bytes() == manifest_first


def test_second_run_changes_nothing(demo, capsys):
    demo.series(P1)
    assert demo.run("patched") == 0
    capsys.readouterr()
    git_dir = demo.work / "src" / "demo" / ".git"
    before = sorted((p, p.stat().st_mtime_ns) for p in git_dir.rglob("*") if p.is_file())
    assert demo.run("patched") == 0
    out = capsys.readouterr().out
    assert "unchanged work/src/demo" in out and "unchanged" in out.splitlines()[-1]
    assert sorted((p, p.stat().st_mtime_ns) for p in git_dir.rglob("*") if p.is_file()) == before


def test_one_commit_per_patch_with_its_subject(demo):
    demo.series(P1, P2)
    assert demo.run("patched") == 0
    repo = Repo(demo.work / "src" / "demo")
    subjects = repo.out("log", "--format=%s", "refs/dist/pristine..HEAD").splitlines()
    assert subjects == ["[Feature] f30 returns ninety", "[Bugfix] f5 returns fifty"]
    assert "return 50" in (demo.work / "src" / "demo" / "demo" / "core.py").read_text()


def test_manifest_lists_inputs_patches_and_trees(demo):
    demo.series(P1)
    assert demo.run("patched") == 0
    manifest = json.loads((demo.work / "manifest.json").read_text())
    assert [i["filename"] for i in manifest["inputs"]] == ["demo-1.0.tar.gz"]
    entry = manifest["upstreams"]["demo"]
    assert entry["patches"][0]["file"] == P1[0]
    assert entry["patches"][0]["subject"] == "[Bugfix] f5 returns fifty"
    assert entry["patches"][0]["forwarded"] == "not-yet"
    assert len(entry["pristine_tree"]) == 40 and entry["pristine_tree"] != entry["patched_tree"]


def test_export_of_an_unchanged_tree_is_byte_identical(demo, capsys):
    directory = demo.series(P1, P2)
    assert demo.run("patched") == 0
    # Normalise once: hand-written patches lack git's index lines and stat.
    assert demo.run("export", "demo") == 0
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert demo.run("patched") == 0
    assert demo.run("export", "demo") == 0
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert "0 written" in capsys.readouterr().out.splitlines()[-1]


def test_developer_commit_exports_as_a_new_patch_that_reapplies(demo, tmp_path):
    directory = demo.series(P1)
    assert demo.run("patched") == 0
    tree = demo.work / "src" / "demo"
    core = tree / "demo" / "core.py"
    core.write_text(core.read_text().replace("    return 7\n", "    return 77\n"))
    repo = Repo(tree)
    repo.git("commit", "-qam",
             "[Bugfix] f7 returns seventy-seven\n\nForwarded: not-yet\nSigned-off-by: Dev <dev@localhost>")
    dev_tree = repo.tree()
    assert demo.run("export", "demo") == 0
    assert series_entries(directory / "series") == [P1[0], "0002-Bugfix-f7-returns-seventy-seven.patch"]
    demo.work = tmp_path / "fresh-work"
    assert demo.run("patched") == 0
    assert Repo(demo.work / "src" / "demo").tree() == dev_tree


def test_health_reports_applies_contained_conflicts(demo, capsys):
    conflicting = ("0003-touch-f12.patch",
                   patch_text("f12 change", "demo/core.py", "    return 12", "    return 120", ["def f12():"], 37))
    demo.series(P1, P2, conflicting)
    files = dict(BASE_FILES)
    core = files["demo/core.py"]
    core = core.replace("    return 30\n", "    return 90\n")          # upstream took P2
    core = core.replace("def f12():\n    return 12", "def f12():\n    return -12")  # and changed f12
    files["demo/core.py"] = core
    demo.publish("1.1", files)
    assert demo.run("health", "demo==1.1") == 0
    out = capsys.readouterr().out
    status = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith("000")}
    assert status == {P1[0]: "applies", P2[0]: "contained", conflicting[0]: "conflicts"}
    assert "demo/core.py:37" in out
    assert demo.run("health", "demo==1.1", "--strict") == 1


def test_pristine_tree_command_writes_the_unpatched_sources(demo, tmp_path, capsys):
    demo.series(P1)
    assert demo.run("patched") == 0
    capsys.readouterr()
    dest = tmp_path / "pristine"
    assert demo.run("pristine-tree", "demo", str(dest)) == 0
    assert "    return 5\n" in (dest / "demo" / "core.py").read_text()
    assert capsys.readouterr().out.strip() == Repo(demo.work / "src" / "demo").tree("refs/dist/pristine")


def test_git_identity_does_not_leak_from_the_user(demo, monkeypatch):
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Somebody Else")
    monkeypatch.setenv("GIT_COMMITTER_DATE", "2024-05-05T05:05:05Z")
    demo.series(P1)
    assert demo.run("patched") == 0
    log = subprocess.run(["git", "log", "--format=%an %cI", "-1", "refs/dist/pristine"],
                         cwd=demo.work / "src" / "demo", capture_output=True, text=True).stdout
    assert log.strip() == "GLM-5.3 B300 distribution 2000-01-01T00:00:00+00:00"


def _authors(directory) -> dict[str, tuple[str, list[str]]]:
    found = {}
    for entry in series_entries(directory / "series"):
        header = (directory / entry).read_text().partition("\n---\n")[0]
        author = next(line for line in header.splitlines() if line.startswith("From: "))
        found[entry] = (author, [line for line in header.splitlines() if line.startswith("Signed-off-by:")])
    return found


def test_export_under_one_identity_authors_and_signs_every_patch(demo, tmp_path, capsys):
    directory = demo.series(P1)
    assert demo.run("patched") == 0
    tree = demo.work / "src" / "demo"
    core = tree / "demo" / "core.py"
    core.write_text(core.read_text().replace("    return 7\n", "    return 77\n"))
    repo = Repo(tree)
    # A contributor's commit, signed twice by others: the forwarder re-signs it.
    repo.git("-c", "user.name=Other", "-c", "user.email=other@localhost", "commit", "-qam",
             "[Bugfix] f7 returns seventy-seven\n\nForwarded: not-yet\n"
             "Signed-off-by: Other <other@localhost>\nSigned-off-by: Third <third@localhost>")
    dev_tree = repo.tree()
    assert demo.run("export", "demo", "--identity", "Jörg Forwarder <jf@example.org>") == 0
    authors = _authors(directory)
    assert len(authors) == 2
    for author, sign_offs in authors.values():
        assert author == "From: =?UTF-8?q?J=C3=B6rg=20Forwarder?= <jf@example.org>"
        assert sign_offs == ["Signed-off-by: Jörg Forwarder <jf@example.org>"]
    capsys.readouterr()
    assert demo.run("lint") == 0
    # The patches re-apply to the same tree, and a plain re-export keeps the identity.
    demo.work = tmp_path / "fresh-work"
    assert demo.run("patched") == 0
    assert Repo(demo.work / "src" / "demo").tree() == dev_tree
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert demo.run("export", "demo") == 0
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


def test_lint_names_a_patch_signed_by_someone_else_and_a_mixed_series(demo, capsys):
    other = P2[1].replace("Signed-off-by: Dev <dev@localhost>", "Signed-off-by: Eve <eve@localhost>")
    other = other.replace("From: Dev <dev@localhost>", "From: Eve <eve@localhost>", 1)
    unsigned_author = P1[1].replace("Signed-off-by: Dev <dev@localhost>", "Signed-off-by: Eve <eve@localhost>")
    demo.series((P1[0], unsigned_author), (P2[0], other))
    assert demo.run("lint") == 1
    err = capsys.readouterr().err
    assert f"{P1[0]}: signed off by Eve <eve@localhost>, authored by Dev <dev@localhost>" in err
    assert "2 identities in one series: Dev <dev@localhost> (0001-return-fifty.patch); Eve <eve@localhost>" in err


def test_export_refuses_a_malformed_identity_and_writes_nothing(demo, capsys):
    directory = demo.series(P1)
    assert demo.run("patched") == 0
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert demo.run("export", "demo", "--identity", "no-email-here") != 0
    assert ("--identity: 'no-email-here' is not an identity; write it as 'Full Name <name@host>'"
            in capsys.readouterr().err)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
