"""Self-test logic on real inputs: a git tree made the way distbuild makes one,
installed files, shared objects built here and inspected with the real ldd."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from imagectl import selftest, treemap


def git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, env=env).stdout


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """pristine commit + one patch commit, with the refs distbuild sets."""
    repo = tmp_path / "src" / "demo"
    (repo / "demo").mkdir(parents=True)
    (repo / "csrc").mkdir()
    (repo / "demo" / "__init__.py").write_text("X = 1\n")
    (repo / "demo" / "core.py").write_text("def f():\n    return 'pristine'\n")
    (repo / "csrc" / "k.cu").write_text("// kernel\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_core.py").write_text("")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "pristine")
    git(repo, "update-ref", treemap.PRISTINE_REF, "HEAD")
    (repo / "demo" / "core.py").write_text("def f():\n    return 'patched'\n")
    (repo / "csrc" / "k.cu").write_text("// kernel, patched\n")
    (repo / "tests" / "test_core.py").write_text("def test_f(): pass\n")
    git(repo, "commit", "-qam", "patch")
    git(repo, "update-ref", treemap.PREPARED_REF, "HEAD")
    return repo


def install(site: Path, repo: Path, ref: str, data_prefix: str = "") -> None:
    for path in git(repo, "ls-tree", "-r", "--name-only", ref).split():
        if path.startswith("tests/"):
            continue
        dest = site / (data_prefix if path.startswith("csrc/") else "") / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(subprocess.run(["git", "-C", str(repo), "show", f"{ref}:{path}"], capture_output=True, check=True).stdout)


def test_blob_id_is_gits(tree: Path) -> None:
    data = (tree / "demo" / "core.py").read_bytes()
    assert treemap.blob_id(data) == git(tree, "hash-object", "demo/core.py").strip()


def test_treemap_lists_the_series_changes(tree: Path) -> None:
    data = treemap.tree_map(tree)
    assert set(data["changed"]) == {"demo/core.py", "csrc/k.cu", "tests/test_core.py"}
    assert data["patched_tree"] == git(tree, "rev-parse", "HEAD^{tree}").strip()
    out = tree.parent.parent / "trees"
    assert treemap.main([str(tree.parent), str(out)]) == 0
    assert json.loads((out / "demo.json").read_text()) == data


def test_patched_install_passes(tree: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    install(site, tree, treemap.PREPARED_REF, "demo/data")
    check = selftest.compare_tree("demo", treemap.tree_map(tree), site, "demo", ("demo/data",))
    assert check.status == "PASS", check.detail
    assert "2 patched by the series" in check.detail and "1 series files" in check.detail


def test_pristine_install_fails_naming_the_file(tree: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    install(site, tree, treemap.PRISTINE_REF, "demo/data")
    check = selftest.compare_tree("demo", treemap.tree_map(tree), site, "demo", ("demo/data",))
    assert check.status == "FAIL" and check.detail == "PRISTINE content installed for csrc/k.cu, demo/core.py"


def test_foreign_content_fails(tree: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    install(site, tree, treemap.PREPARED_REF, "demo/data")
    (site / "demo" / "__init__.py").write_text("X = 2\n")
    check = selftest.compare_tree("demo", treemap.tree_map(tree), site, "demo", ("demo/data",))
    assert check.status == "FAIL" and "demo/__init__.py" in check.detail


def test_versions() -> None:
    assert selftest.check_version("vllm", "0.31.0", "0.31.0").status == "PASS"
    assert selftest.check_version("vllm", "0.30.0", "0.31.0").status == "FAIL"
    assert selftest.check_version("vllm", None, "0.31.0").status == "FAIL"
    assert selftest.check_version("lmcache", "0.5.5+glm53.abc", "0.5.5", local="glm53.abc").status == "PASS"
    assert selftest.check_version("lmcache", "0.5.5", "0.5.5", local="glm53.abc").status == "FAIL"
    pins = selftest._pin_versions({"inputs": [{"name": "nixl_cu13", "version": "1.5.1", "role": "image"},
                                              {"name": "nvidia-cuda-nvcc", "version": "13", "role": "toolchain"}]})
    assert pins == {"nixl-cu13": "1.5.1"}


def _cc(tmp_path: Path, name: str, source: str, *flags: str) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.fail("gcc is needed (make test's prerequisites include g++)")
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / name
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(out), str(src), *flags], check=True)
    return out


def test_ldd_of_plugins_names_a_missing_library(tmp_path: Path) -> None:
    plugins = tmp_path / "nixl_cu13.libs" / "plugins"
    plugins.mkdir(parents=True)
    dep = _cc(tmp_path, "libfabric.so.1", "int fi_version(void) { return 1; }\n", "-Wl,-soname,libfabric.so.1")
    fabric = _cc(plugins, "libplugin_LIBFABRIC.so", "int fi_version(void); int p(void) { return fi_version(); }\n",
                 f"-L{tmp_path}", "-l:libfabric.so.1", f"-Wl,-rpath,{tmp_path}")
    _cc(plugins, "libplugin_UCX.so", "int u(void) { return 0; }\n")
    found = selftest.nixl_plugins(tmp_path)
    assert [p.name for p in found] == ["libplugin_LIBFABRIC.so", "libplugin_UCX.so"]
    good = selftest.check_ldd(found)
    assert good.status == "PASS" and f"libfabric.so.1 => {dep}" in good.detail
    dep.unlink()
    bad = selftest.check_ldd(found)
    assert bad.status == "FAIL" and "libplugin_LIBFABRIC.so: libfabric.so.1" in bad.detail
    assert fabric.exists()
    assert selftest.check_ldd([]).status == "FAIL"


def test_aot_status(tmp_path: Path) -> None:
    site = tmp_path / "site"
    so = site / "flashinfer" / "data" / "aot" / selftest.AOT_MODULE / f"{selftest.AOT_MODULE}.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(b"\x7fELF fake module bytes")
    import hashlib
    built = {"status": "built", "cuda_arch_list": "10.3a", "sha256": hashlib.sha256(so.read_bytes()).hexdigest()}
    resolves_to_ours = lambda name: so  # noqa: E731 - FlashInfer's get_aot_path answer
    assert selftest.check_aot(built, site, resolves_to_ours).status == "PASS"
    assert selftest.check_aot(dict(built, sha256="0" * 64), site, resolves_to_ours).status == "FAIL"
    elsewhere = selftest.check_aot(built, site, lambda name: tmp_path / "other.so")
    assert elsewhere.status == "FAIL" and "resolves" in elsewhere.detail
    missing = {"status": "missing", "cuda_arch_list": "10.3a", "reason": "artifact store unreachable from the build",
               "consequence": "JIT at first use with network access"}
    so.unlink()
    check = selftest.check_aot(missing, site, resolves_to_ours)
    assert check.status == "WARN" and "MISSING" in check.detail and "unreachable" in check.detail and "JIT" in check.detail
    assert selftest.exit_code([check], strict=True) == 1


def test_report_and_exit_codes() -> None:
    checks = [selftest.Check("a", "PASS", "ok"), selftest.Check("b", "WARN", "missing x")]
    text = selftest.render(checks, "title")
    assert text.splitlines()[-1] == "self-test: 1 pass, 1 warn, 0 fail"
    assert len(text.splitlines()) <= 24   # one screen
    assert selftest.exit_code(checks, strict=False) == 0
    assert selftest.exit_code(checks, strict=True) == 1
    assert selftest.exit_code(checks + [selftest.Check("c", "FAIL", "")], strict=False) == 1
