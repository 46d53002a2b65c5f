"""make image-repro's comparison (build/distbuild/host/repro.py), the layer table and the provenance
``make image`` stamps. The real double build of the first stages is in test_build.py."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

from distbuild.host import engine as engine_step, image, layertable, repro

from .conftest import REPO


def _tree(root: Path, files: dict[str, str], mtime: int = 1_800_000_000) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        os.utime(p, (mtime, mtime))
    return root


def test_a_differing_layer_names_each_file_and_what_differs(tmp_path: Path) -> None:
    a = repro.list_tree(_tree(tmp_path / "a", {"usr/lib/x.pyc": "one", "etc/shadow": "s", "same": "="}))
    b_root = _tree(tmp_path / "b", {"usr/lib/x.pyc": "two", "etc/shadow": "s", "same": "=", "var/log/dpkg.log": "t"})
    os.utime(b_root / "etc" / "shadow", (1_800_000_123, 1_800_000_123))
    b = repro.list_tree(b_root)
    lines = repro.diff_listings(a, b)
    assert "usr/lib/x.pyc: content (sha256/target) differs" in lines
    assert "etc/shadow: mtime 1800000000 != 1800000123" in lines
    assert "only in build 2: var/log/dpkg.log" in lines
    assert not any(line.startswith("same") for line in lines)
    assert repro.diff_listings(a, repro.list_tree(tmp_path / "a")) == []


def test_a_directory_or_whiteout_mtime_alone_is_counted_not_listed() -> None:
    # [type, mode, uid, gid, size, mtime, content], as list_tree records them
    a = {"tmp/wheels": ["dir", "0o755", 0, 0, 0, 1796284578, ""],
         "build/.git": ["whiteout", "0o0", 0, 0, 0, 1796284288, ""],
         "opt/f": ["file", "0o644", 0, 0, 1, 1796284578, "x"],
         "opt/d": ["dir", "0o755", 0, 0, 0, 1, ""]}
    b = {"tmp/wheels": ["dir", "0o755", 0, 0, 0, 1796285572, ""],
         "build/.git": ["whiteout", "0o0", 0, 0, 0, 1796285291, ""],
         "opt/f": ["file", "0o644", 0, 0, 1, 1796285572, "x"],
         "opt/d": ["dir", "0o700", 0, 0, 0, 2, ""]}
    lines = repro.diff_listings(a, b)
    assert lines == ["opt/d: mode '0o755' != '0o700', mtime 1 != 2",
                     "opt/f: mtime 1796284578 != 1796285572",
                     "(and 2 directory or whiteout mtime(s) that differ only on disk: the layer tar clamps them to "
                     "SOURCE_DATE_EPOCH)"]


def test_compare_reports_equal_stages_and_names_the_layer_that_differs(tmp_path: Path) -> None:
    files = repro.list_tree(_tree(tmp_path / "l", {"f": "1"}))
    other = repro.list_tree(_tree(tmp_path / "m", {"f": "2"}))
    one = {"digests": {"s:base": {"content": "c1", "id": "1", "digest": "sha256:a"},
                       "s:x": {"content": "c2", "id": "2", "digest": "sha256:b"}},
           "layers": {"s:base": [{"diff_id": "d1", "files": files}],
                      "s:x": [{"diff_id": "d1", "files": files}, {"diff_id": "d2", "files": files}]}}
    two = {"digests": {"s:base": {"content": "c1", "id": "1", "digest": "sha256:a"},
                       "s:x": {"content": "c3", "id": "3", "digest": "sha256:c"}},
           "layers": {"s:base": [{"diff_id": "d1", "files": files}],
                      "s:x": [{"diff_id": "d1", "files": files}, {"diff_id": "d3", "files": other}]}}
    result = repro.compare(one, two)
    assert result["same"] is False and result["stages"]["s:base"]["same"] is True
    layers = result["stages"]["s:x"]["layers"]
    assert [(layer["layer"], layer["build1"], layer["build2"]) for layer in layers] == [(2, "d2", "d3")]
    assert layers[0]["files"] == ["f: content (sha256/target) differs"]
    text = repro.format_result(result)
    assert "DIFFERS  s:x" in text and "FAIL" in text.splitlines()[-1]
    assert repro.compare(one, one)["same"] is True


def test_the_content_digest_leaves_out_only_the_build_containers_ids() -> None:
    inspect = {"Architecture": "amd64", "Os": "linux", "Created": "2026-12-01T14:12:55Z", "Config": {"Env": ["A=1"]},
               "RootFS": {"Layers": ["sha256:l1"]},
               "History": [{"created": "t", "created_by": "RUN x", "comment": "FROM 928999b0f3ce"},
                           {"created": "t", "created_by": "ENV", "comment": "FROM localhost/glm53-base:bookworm",
                            "empty_layer": True}]}
    other = json.loads(json.dumps(inspect))
    other["History"][0]["comment"] = "FROM d13a546bad7c"   # another build's intermediate image
    assert repro.content_digest(repro.canonical_config(inspect)) == repro.content_digest(repro.canonical_config(other))
    for key, value in (("Created", "2026-12-02T00:00:00Z"), ("Config", {"Env": ["A=2"]}),
                       ("RootFS", {"Layers": ["x"]})):
        changed = dict(inspect, **{key: value})
        assert (repro.content_digest(repro.canonical_config(changed))
                != repro.content_digest(repro.canonical_config(inspect)))
    named = json.loads(json.dumps(inspect))
    named["History"][1]["comment"] = "FROM localhost/other:tag"   # a named base is content
    assert repro.content_digest(repro.canonical_config(named)) != repro.content_digest(repro.canonical_config(inspect))


def test_the_clean_storage_wrapper_points_the_engine_at_its_own_root(tmp_path: Path) -> None:
    script = repro.wrapper(tmp_path / "bin", "/bin/echo", tmp_path / "root")
    out = subprocess.run([str(script), "images"], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["--root", str(tmp_path / "root" / "storage"), "--runroot", str(tmp_path / "root" / "run"), "images"]


def _blob(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def test_the_layer_table_reads_compressed_and_uncompressed_sizes_from_an_oci_layout(tmp_path: Path) -> None:
    layout = tmp_path / "oci"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("opt/big")
        payload = b"\0" * 100_000
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    layer = _blob(layout, gzip.compress(raw.getvalue(), mtime=0))
    config = _blob(layout, json.dumps({"rootfs": {"diff_ids": ["sha256:x"]}, "history": [
        {"created_by": "/bin/sh -c #(nop) ENV A=1", "empty_layer": True},
        {"created_by": "|2 A=1 B=2 /bin/sh -c --mount=type=cache,target=/root/.cache/pip "
         "pip install -r nvidia.txt"}]}).encode())
    manifest = _blob(layout, json.dumps({"config": config, "layers": [
        {**layer, "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip"}]}).encode())
    (layout / "index.json").write_text(json.dumps({"manifests": [manifest]}))
    rows = layertable.read_layout(layout)
    assert rows == [{"layer": 1, "step": "RUN pip install -r nvidia.txt", "compressed": layer["size"],
                     "size": len(raw.getvalue()), "diff_id": "sha256:x"}]
    assert rows[0]["compressed"] < rows[0]["size"] / 10
    assert "(1 layers)" in layertable.format_table(rows)


def test_podman_and_buildah_builds_get_the_timestamp_and_docker_builds_do_not() -> None:
    podman = engine_step.Engine("podman", "/usr/bin/podman")
    cmd = podman.build_cmd(REPO, REPO / "Dockerfile", "base", "t", {"SOURCE_DATE_EPOCH": "123"})
    assert image.timestamped(podman, cmd, "123")[:3] == ["/usr/bin/podman", "build", "--timestamp=123"]
    docker = engine_step.Engine("docker", "/usr/bin/docker")
    dcmd = docker.build_cmd(REPO, REPO / "Dockerfile", "base", "t", {"SOURCE_DATE_EPOCH": "123"})
    assert image.timestamped(docker, dcmd, "123") == dcmd and "--build-arg=SOURCE_DATE_EPOCH=123" in dcmd


def test_the_epoch_is_the_commit_time_of_the_last_change_to_the_build_inputs(tmp_path: Path) -> None:
    repo = tmp_path / "r"
    repo.mkdir()
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    env.pop("SOURCE_DATE_EPOCH", None)

    def commit(path: str, when: int) -> None:
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(str(when))
        subprocess.run(["git", "-C", str(repo), "add", path], check=True, env=env)
        subprocess.run(["git", "-C", str(repo), "commit", "-qm", path], check=True,
                       env={**env, "GIT_COMMITTER_DATE": f"@{when} +0000", "GIT_AUTHOR_DATE": f"@{when} +0000"})

    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    commit("Dockerfile", 1_800_000_000)
    commit("configs/x.yaml", 1_800_000_500)   # not a compile-stage input
    commit(".dockerignore", 1_800_000_600)
    (repo / ".dockerignore").write_text("# host-side\nbuild/distbuild/host/\nwork/\n**/__pycache__/\n")
    subprocess.run(["git", "-C", str(repo), "commit", "-qam", "ignore", "--date=@1800000600"], check=True,
                   env={**env, "GIT_COMMITTER_DATE": "@1800000600 +0000"})
    commit("build/distbuild/host/testenv.py", 1_800_000_900)   # outside the build context: no stage reads it
    commit("build/__pycache__/x.pyc", 1_800_000_950)
    saved = os.environ.pop("SOURCE_DATE_EPOCH", None)
    try:
        assert image.input_epoch(repo, image.BUILD_INPUTS) == 1_800_000_600
        # The base is made by host-side code outside the context: a change to it dates the base.
        commit("build/distbuild/host/baseimage.py", 1_800_000_700)
        assert image.input_epoch(repo, image.BASE_INPUTS, in_build_context=False) == 1_800_000_700
        assert image.input_epoch(repo, image.BUILD_INPUTS) == 1_800_000_600
        commit("build/distbuild/pins.py", 1_800_001_000)   # in the context: the stages read it
        assert image.input_epoch(repo, image.BUILD_INPUTS) == 1_800_001_000
        prov = image.provenance(repo)
        assert prov["IMAGE_CREATED"] == "2027-01-15T08:16:40Z"   # HEAD's commit time, UTC
        assert len(prov["IMAGE_REVISION"]) == 40
        (repo / "Dockerfile").write_text("edited")
        assert image.provenance(repo)["IMAGE_REVISION"].endswith("-dirty")
    finally:
        if saved is not None:
            os.environ["SOURCE_DATE_EPOCH"] = saved
