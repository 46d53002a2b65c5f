"""The image's KV key epoch (imagectl/keyepoch.py): derived from the build's trees, given to LMCache
by the entrypoint unless the operator chose one, and shown as a label."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from imagectl import keyepoch, labels

from .conftest import REPO

TREES = {"flashinfer": "7b16041eb6f455c337480f5937d98d722fd46179",
         "lmcache": "31dac6b38ad65bdb9c4d86473bcbe6352ea9fa27",
         "vllm": "26daf172f50f2fa189d419284210a30c4a029c4f"}


def manifest(**trees: str) -> dict:
    return {"schema": 1, "inputs": [{"filename": "torch.whl", "sha256": "1" * 64}], "outputs": {},
            "upstreams": {name: {"patched_tree": tree, "pristine_tree": "0" * 40, "series_sha256": "2" * 64,
                                 "patches": []}
                          for name, tree in {**TREES, **trees}.items()}}


def test_the_epoch_is_short_hex_and_follows_every_kv_tree_only() -> None:
    epoch = keyepoch.image_epoch(manifest())
    assert len(epoch) == keyepoch.LENGTH and int(epoch, 16) >= 0
    assert keyepoch.image_epoch(manifest()) == epoch   # the same trees, the same epoch
    for name in keyepoch.KV_UPSTREAMS:
        assert keyepoch.image_epoch(manifest(**{name: "f" * 40})) != epoch, name
    # What the KV does not depend on leaves it: other inputs (a wheel, a Debian package), the
    # outputs, the pristine trees.
    other = copy.deepcopy(manifest())
    other["inputs"].append({"filename": "valkey.deb", "sha256": "3" * 64})
    other["outputs"]["wheel:lmcache"] = {"file": "lmcache.whl", "sha256": "4" * 64}
    for entry in other["upstreams"].values():
        entry["pristine_tree"] = "5" * 40
    assert keyepoch.image_epoch(other) == epoch
    # A patched upstream added later counts as well.
    assert keyepoch.image_epoch(manifest(deepgemm="6" * 40)) != epoch


def test_a_manifest_without_a_kv_tree_has_no_epoch() -> None:
    broken = manifest()
    del broken["upstreams"]["flashinfer"]
    broken["upstreams"]["vllm"].pop("patched_tree")
    with pytest.raises(ValueError, match="no patched tree of flashinfer, vllm"):
        keyepoch.image_epoch(broken)
    assert labels.build_args(broken, "missing")["KV_KEY_EPOCH"] == "unknown"


def test_the_label_is_the_entrypoints_epoch() -> None:
    args = labels.build_args(manifest(), "missing")
    assert args["KV_KEY_EPOCH"] == keyepoch.image_epoch(manifest())
    assert labels.LABEL_OF_ARG["KV_KEY_EPOCH"] == "io.glm53.kv-key-epoch"
    good = {labels.LABEL_OF_ARG[k]: v for k, v in args.items()}
    assert labels.mismatches(dict(good, **{"io.glm53.kv-key-epoch": "0" * 12}), manifest(), "missing")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "manifest.json").write_text(json.dumps(manifest()))
    return tmp_path


def test_the_entrypoint_gives_the_image_epoch_unless_the_operator_chose(home: Path, tmp_path: Path) -> None:
    epoch = keyepoch.image_epoch(manifest())
    added, said = keyepoch.default_env({}, home / "manifest.json")
    assert added == {"LMCACHE_KV_KEY_EPOCH": epoch} and epoch in said
    # The environment's value wins, an empty one too (no epoch: keys as before).
    for chosen in ("shared-2026", ""):
        added, said = keyepoch.default_env({"LMCACHE_KV_KEY_EPOCH": chosen}, home / "manifest.json")
        assert added == {} and "operator" in said
    # So does the LMCache config file's kv_key_epoch (the chart writes it there), even null.
    config = tmp_path / "lmcache.yaml"
    for line in ("kv_key_epoch: shared-2026", "kv_key_epoch: null", "kv_key_epoch: ''"):
        config.write_text(f"chunk_size: 256\n{line}\n")
        assert keyepoch.default_env({"LMCACHE_CONFIG_FILE": str(config)}, home / "manifest.json") == \
            ({}, f"kv_key_epoch from {config}")
    # A config file without it, or one LMCache will refuse anyway, leaves the image's.
    for text in ("chunk_size: 256\n# kv_key_epoch: x\n", "[not: a mapping\n"):
        config.write_text(text)
        added, _ = keyepoch.default_env({"LMCACHE_CONFIG_FILE": str(config)}, home / "manifest.json")
        assert added == {"LMCACHE_KV_KEY_EPOCH": epoch}, text
    added, _ = keyepoch.default_env({"LMCACHE_CONFIG_FILE": str(tmp_path / "absent.yaml")}, home / "manifest.json")
    assert added == {"LMCACHE_KV_KEY_EPOCH": epoch}


def test_without_a_manifest_the_entrypoint_says_there_is_no_epoch(tmp_path: Path) -> None:
    added, said = keyepoch.default_env({}, tmp_path / "manifest.json")
    assert added == {} and said.startswith("no KV key epoch") and "manifest.json" in said


def run_entrypoint(home: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("LMCACHE_KV_KEY_EPOCH", "LMCACHE_CONFIG_FILE")}
    environ.update(GLM53_HOME=str(home), GLM53_PHASE_LOG="0", **env)
    return subprocess.run([sys.executable, str(REPO / "image" / "entrypoint"), *args], env=environ,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("env", "want"), [
    ({}, "image"),
    ({"LMCACHE_KV_KEY_EPOCH": "shared-2026"}, "shared-2026"),
    ({"LMCACHE_KV_KEY_EPOCH": ""}, ""),
], ids=["image", "chosen", "opted-out"])
def test_docker_run_gets_the_epoch_through_the_entrypoint(home: Path, env: dict[str, str], want: str) -> None:
    """What `docker run IMAGE sh -c ...` sees: the image's epoch, or the one given with -e."""
    out = run_entrypoint(home, env, "sh", "-c", 'printf "%s" "${LMCACHE_KV_KEY_EPOCH-unset}"')
    assert out.returncode == 0, out.stderr
    expected = keyepoch.image_epoch(manifest()) if want == "image" else want
    assert out.stdout == expected
    assert "entrypoint: LMCACHE_KV_KEY_EPOCH" in out.stderr
