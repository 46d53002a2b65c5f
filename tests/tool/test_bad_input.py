"""Every bad input gets an error naming what is wrong, a non-zero exit and
nothing half-written."""
from __future__ import annotations

import pytest

from distbuild.gitrepo import Repo
from distbuild.pins import Pin
from tests.support.ports import free_loopback_port

from .conftest import patch_text

GOOD = ("0001-ok.patch", patch_text("[Bugfix] ok", "demo/core.py", "    return 5", "    return 50", ["def f5():"], 16))


def leftovers(demo) -> list[str]:
    cache = demo.work / "cache"
    src = demo.work / "src"
    found = [p.name for p in cache.iterdir()] if cache.exists() else []
    found += [p.name for p in src.iterdir() if p.name.startswith(".")] if src.exists() else []
    return found


def test_hash_mismatch_between_pin_and_index_downloads_nothing(demo, capsys):
    pin = demo.publish("1.0", {"x": "y"})  # republish: same name, different bytes
    demo.pin(Pin("demo", "1.0", "sdist", "upstream", "demo-1.0.tar.gz", "0" * 64, pin.size, upstream="demo"))
    assert demo.run("sources") == 2
    err = capsys.readouterr().err
    assert "demo-1.0.tar.gz" in err and "0" * 64 in err
    assert leftovers(demo) == []


def test_corrupt_file_is_deleted_and_both_hashes_named(demo, capsys):
    demo.series()
    sdist = demo.files / "demo-1.0.tar.gz"
    data = bytearray(sdist.read_bytes())
    data[-40] ^= 0xFF  # same size, different bytes: the index page still lists the good hash
    sdist.write_bytes(bytes(data))
    assert demo.run("sources") == 2
    err = capsys.readouterr().err
    assert "sha256 mismatch" in err and "expected" in err and "got" in err and "demo-1.0.tar.gz" in err
    assert leftovers(demo) == []


def test_truncated_download_is_deleted(demo, capsys):
    sdist = demo.files / "demo-1.0.tar.gz"
    sdist.write_bytes(sdist.read_bytes()[:100])
    assert demo.run("sources") == 2
    err = capsys.readouterr().err
    assert "truncated download" in err and "demo-1.0.tar.gz" in err
    assert leftovers(demo) == []


def test_corrupt_cache_entry_is_replaced(demo):
    assert demo.run("sources") == 0
    cached = demo.work / "cache" / "demo-1.0.tar.gz"
    good = cached.read_bytes()
    cached.write_bytes(b"garbage")
    assert demo.run("sources") == 0
    assert cached.read_bytes() == good


def test_unknown_upstream_is_named(demo, capsys):
    assert demo.run("patched", "nosuch") == 2
    assert "unknown upstream 'nosuch'" in capsys.readouterr().err


def test_unknown_version_is_named_with_what_exists(demo, capsys):
    assert demo.run("health", "demo==9.9") == 2
    err = capsys.readouterr().err
    assert "demo==9.9: no sdist" in err and "1.0" in err


def test_malformed_spec_is_named(demo, capsys):
    assert demo.run("health", "demo>=1") == 2
    assert "'demo>=1': expected NAME==VERSION" in capsys.readouterr().err


def test_series_entry_without_file(demo, capsys):
    directory = demo.series(GOOD)
    (directory / "series").write_text(f"{GOOD[0]}\n0002-gone.patch\n")
    assert demo.run("patched") == 2
    assert "lists 0002-gone.patch, which does not exist" in capsys.readouterr().err


def test_patch_file_not_in_series(demo, capsys):
    directory = demo.series(GOOD)
    (directory / "0002-stray.patch").write_text(GOOD[1])
    assert demo.run("patched") == 2
    assert "0002-stray.patch not listed in the series" in capsys.readouterr().err


def test_conflicting_patch_stops_and_leaves_the_last_good_tree(demo, capsys):
    demo.series(GOOD)
    assert demo.run("patched") == 0
    good_head = Repo(demo.work / "src" / "demo").head()
    bad = ("0002-bad.patch",
           patch_text("[Bugfix] bad", "demo/core.py", "    return 999", "    return 1", ["def f9():"], 28))
    demo.series(GOOD, bad)
    capsys.readouterr()
    assert demo.run("patched") == 2
    err = capsys.readouterr().err
    assert "patch 0002-bad.patch does not apply: demo/core.py hunk at line 28" in err
    assert Repo(demo.work / "src" / "demo").head() == good_head
    assert not Repo(demo.work / "src" / "demo").dirty()
    assert leftovers(demo) == ["demo-1.0.tar.gz"]


def test_dirty_tree_is_not_overwritten_without_force(demo, capsys):
    demo.series(GOOD)
    assert demo.run("patched") == 0
    core = demo.work / "src" / "demo" / "demo" / "core.py"
    core.write_text(core.read_text() + "# half an edit\n")
    demo.series()
    assert demo.run("patched") == 2
    err = capsys.readouterr().err
    assert "uncommitted changes" in err and "demo/core.py" in err and "FORCE=1" in err
    assert core.read_text().endswith("# half an edit\n")
    assert demo.run("patched", "--force") == 0
    assert not core.read_text().endswith("# half an edit\n")


def test_unexported_commit_is_not_overwritten_without_force(demo, capsys):
    demo.series(GOOD)
    assert demo.run("patched") == 0
    repo = Repo(demo.work / "src" / "demo")
    repo.git("commit", "-q", "--allow-empty", "-m", "wip")
    demo.series()
    assert demo.run("patched") == 2
    assert "make export UPSTREAM=demo" in capsys.readouterr().err


def test_staging_left_by_a_crash_is_cleaned(demo, capsys):
    stale = demo.work / "src" / ".demo.new-12345"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("x")
    assert demo.run("patched") == 0
    assert not stale.exists()
    assert "left by an interrupted run" in capsys.readouterr().out


def test_cold_cache_without_network_fails_clearly(demo, monkeypatch, capsys):
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_loopback_port()}/simple")
    assert demo.run("sources") == 2
    err = capsys.readouterr().err
    assert "demo-1.0.tar.gz: not in" in err and "cannot reach the package index" in err
    assert leftovers(demo) == []


def test_warm_cache_works_offline(demo, monkeypatch):
    assert demo.run("sources") == 0
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_loopback_port()}/simple")
    assert demo.run("patched") == 0


def test_missing_dep3_headers_fail_lint(demo, capsys):
    text = GOOD[1].replace("Forwarded: not-yet\n", "").replace("Signed-off-by: Dev <dev@localhost>\n", "")
    demo.series(("0001-ok.patch", text))
    assert demo.run("lint") == 1
    err = capsys.readouterr().err
    assert "no Signed-off-by" in err and "no DEP-3 Forwarded" in err


def test_lint_holds_a_forward_port_series_to_the_same_rules(demo, capsys):
    """patches/<upstream>-<version>/ (a series rebased on a newer release) goes upstream too: its
    headers, generated files and identity are checked as the pinned series' are."""
    demo.series(GOOD)
    forward = demo.root / "patches" / "demo-2.0"
    forward.mkdir()
    (forward / GOOD[0]).write_text(GOOD[1].replace("Signed-off-by: Dev <dev@localhost>\n", ""))
    (forward / "series").write_text(f"{GOOD[0]}\n")
    assert demo.run("lint") == 1
    captured = capsys.readouterr()
    assert f"{forward / GOOD[0]}: no Signed-off-by" in captured.err
    assert f"{forward}/series: not DCO-ready" in captured.out
    (forward / GOOD[0]).write_text(GOOD[1])
    assert demo.run("lint") == 0


def test_a_bug_field_that_is_not_a_url_fails_lint(demo, capsys):
    text = GOOD[1].replace("Forwarded: not-yet\n", "Forwarded: not-yet\nBug: the GET hangs (write-up #5551)\n")
    demo.series(("0001-ok.patch", text))
    assert demo.run("lint") == 1
    assert ("0001-ok.patch: DEP-3 Bug: must be the URL of an upstream report, not 'the GET hangs (write-up #5551)'"
            in capsys.readouterr().err)
    url = GOOD[1].replace("Forwarded: not-yet\n", "Forwarded: not-yet\nBug: https://github.com/LMCache/LMCache/issues/5293\n")
    demo.series(("0001-ok.patch", url))
    assert demo.run("lint") == 0


def test_malformed_lock_file_names_the_field(demo, capsys):
    (demo.root / "build" / "pins.toml").write_text('[[artifact]]\nname = "demo"\n')
    assert demo.run("sources") == 2
    assert "missing field(s) version" in capsys.readouterr().err


SCM_VERSION = ("0001-version.patch", patch_text(
    "[Build] regenerate", "demo/_version.py", "__version_tuple__ = version_tuple = (1, 0)",
    "__version_tuple__ = version_tuple = (0, 1, 'dev3')", ["__version__ = version = '1.0'"], 20))
BANNER = ("0001-generated.patch", patch_text(
    "[Build] regenerate", "demo/tables.py", "ROWS = 1", "ROWS = 2", ["# generated by tablegen; do not edit"], 1))


@pytest.mark.parametrize("patch, why", [(SCM_VERSION, "setuptools-scm's version file"),
                                        (BANNER, "its top says '# generated by tablegen; do not edit'")])
def test_a_patch_that_changes_a_generated_file_fails_lint(demo, capsys, patch, why):
    demo.series(patch)
    assert demo.run("lint") == 1
    err = capsys.readouterr().err
    assert f"{patch[0]}: changes {'demo/_version.py' if patch is SCM_VERSION else 'demo/tables.py'}, " \
           f"a generated file ({why}); drop that hunk" in err


def test_a_do_not_edit_comment_below_the_top_is_not_a_generated_file(demo):
    deep = patch_text("[Docs] warn", "demo/core.py", "    return 30", "    return 30  # do not edit",
                      ["def f30():"], 91)
    demo.series(("0001-deep.patch", deep))
    assert demo.run("lint") == 0


def test_lint_says_a_placeholder_identity_is_not_dco_ready(demo, capsys):
    demo.series(GOOD)
    assert demo.run("lint") == 0   # a notice, not a failure: the tree's series is placeholder-signed by design
    out = capsys.readouterr().out
    assert "series: not DCO-ready: authored and signed off by the placeholder Dev <dev@localhost>" in out
    assert "make export IDENTITY=" in out
    demo.series(("0001-ok.patch", GOOD[1].replace("dev@localhost", "dev@lmcache.ai")))
    assert demo.run("lint") == 0
    assert "not DCO-ready" not in capsys.readouterr().out
