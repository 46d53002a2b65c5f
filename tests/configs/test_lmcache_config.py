"""The LMCache config, loaded by LMCache's own loader (the build in this interpreter).

LMCacheEngineConfig.from_file + update_config_from_env is what LMCache's vLLM
adapter runs (lmcache_get_or_create_config). On its own that loader only logs
unknown keys and turns a value it cannot convert into None or False, so the
wrapper (configs/validate.py) checks keys and types first and names file and key.
"""
from __future__ import annotations

import pytest

from tests.configs.support import CONFIGS

pytestmark = pytest.mark.lmcache

PREFILL = CONFIGS / "prefill" / "lmcache.yaml"


@pytest.fixture(scope="module")
def loaded(validate):
    return validate.check_lmcache_file(PREFILL, CONFIGS / "prefill" / "env")


def test_prefill_lmcache_config_loads(loaded):
    assert loaded.chunk_size == 256
    assert loaded.local_cpu is True
    assert loaded.max_local_cpu_size == 768
    assert loaded.remote_url == "resp://valkey-lmcache-{rank}.vllm.svc.cluster.local:6379"
    assert loaded.enable_async_loading is True
    assert loaded.lookup_timeout_ms == 4000
    assert loaded.blocking_timeout_secs == 5
    assert loaded.extra_config == {"pcp_shard_store": True, "resp_num_threads": 32}


def test_defaults_the_resp_and_mla_paths_require(loaded):
    # redis_adapter.py asserts save_unfull_chunk is False for resp://;
    # MLA requires the naive serde.
    assert loaded.save_unfull_chunk is False
    assert loaded.remote_serde == "naive"


def test_env_file_points_lmcache_at_the_config(validate):
    env = validate.read_env_file(CONFIGS / "prefill" / "env")
    assert env["LMCACHE_CONFIG_FILE"].endswith("/lmcache.yaml")
    assert env["PYTHONHASHSEED"] == "0"
    validate.check_env_file(CONFIGS / "prefill" / "env", vllm=False)


BROKEN = {
    "unknown-key": (("", "\nchunk_sise: 256\n"), "chunk_sise", "did you mean 'chunk_size'"),
    "str-for-int": (("chunk_size: 256", 'chunk_size: "256"'), "chunk_size", "expected int, got str '256'"),
    "str-for-bool": (("enable_async_loading: true", "enable_async_loading: maybe"),
                     "enable_async_loading", "expected bool"),
    "str-for-float": (("max_local_cpu_size: 768", "max_local_cpu_size: lots"), "max_local_cpu_size", "expected float"),
    "extra-unknown": (("resp_num_threads: 32", "resp_num_thread: 32"), "extra_config.resp_num_thread",
                      "did you mean 'resp_num_threads'"),
    "extra-type": (("pcp_shard_store: true", "pcp_shard_store: 1"), "extra_config.pcp_shard_store", "expected bool"),
    "placeholder": (("valkey-lmcache-{rank}", "valkey-lmcache-{worker}"), "remote_url", "only {rank}"),
    "deprecated-alias": (("", "\ncontroller_url: tcp://127.0.0.1:1\n"), "controller_url", "controller_pull_url"),
    "lmcache-validate": (("", "\nmin_retrieve_tokens: -1\n"), "min_retrieve_tokens", "must be >= 0"),
    "key-epoch": (("", "\nkv_key_epoch: cell@a\n"), "kv_key_epoch", "'cell@a' cannot be part of a chunk key"),
    "key-epoch-type": (("", "\nkv_key_epoch: 2026\n"), "kv_key_epoch", "expected str or None, got int 2026"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_lmcache_config_names_file_and_key(validate, tmp_path, case):
    (old, new), key, detail = BROKEN[case]
    text = PREFILL.read_text()
    assert old in text
    broken = tmp_path / "lmcache.yaml"
    broken.write_text(text.replace(old, new, 1) if old else text + new)
    with pytest.raises(validate.ConfigError) as err:
        validate.check_lmcache_file(broken)
    assert err.value.key == key
    assert str(err.value).startswith(f"{broken}: key '{key}': ")
    assert detail in str(err.value)


def test_lmcaches_loader_alone_accepts_a_wrong_type(tmp_path):
    """Why the wrapper checks types: LMCache's loader turns 'maybe' into False silently."""
    from lmcache.v1.config import LMCacheEngineConfig

    broken = tmp_path / "lmcache.yaml"
    broken.write_text(PREFILL.read_text().replace("enable_async_loading: true", "enable_async_loading: maybe"))
    assert LMCacheEngineConfig.from_file(str(broken)).enable_async_loading is False


def test_prefill_config_leaves_the_key_epoch_to_the_image(loaded):
    """The shipped file sets no kv_key_epoch (patch 0030): the image's entrypoint gives its own."""
    assert loaded.kv_key_epoch is None


@pytest.mark.parametrize("line, key", [
    ("LMCACHE_CHUNK_SIZE=512", "LMCACHE_CHUNK_SIZE"),
    ("LMCACHE_KV_KEY_EPOCH=shared", "LMCACHE_KV_KEY_EPOCH"),
    ("LMCACHE_REMOTE_URLS=resp://x:1", "LMCACHE_REMOTE_URLS"),
])
def test_env_may_not_override_the_yaml(validate, tmp_path, line, key):
    env = tmp_path / "env"
    env.write_text((CONFIGS / "prefill" / "env").read_text() + line + "\n")
    with pytest.raises(validate.ConfigError) as err:
        validate.check_env_file(env, vllm=False)
    assert str(err.value).startswith(f"{env}: key '{key}': ")
