"""kv-sizing: the chunk figure from GLM-5.3's config by vLLM's rule, the write-up's cost model reproduced from its own
inputs, the model for a cell of P pods sharing the shards, bad input, and --measure on real Valkey: through
valkey-py from the ops environment, and through LMCache's native RESP client."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from tests.configs.support import CONFIGS, SCRIPTS, load_kvsizing
from tests.support.ports import free_loopback_port
from tests.support.valkey import start_valkey

kvsizing = load_kvsizing()
model = kvsizing.model
geometry = kvsizing.geometry
cli = kvsizing.cli
from kvsizing import measure  # noqa: E402  (on sys.path after load_kvsizing)
GB = 1e9

# The write-up's inputs: 12.4 MB per 256-token chunk (its figure, within 1.5% of the real 12.2 MB); a 16k
# (16,384-token) prompt prefilled in 0.31 s; hit-heavy replay 450 requests in 374 s.
S = 12.4e6 / 256
R = 16384 / 0.31
N_TOKENS = 16384
LAMBDA = 450 / 374

WRITEUP = ["--chunk-bytes", "12.4MB", "--chunk-tokens", "256", "--prefill-rate", "16Ki/0.31s",
           "--prompt-tokens", "16Ki", "--arrival-rate", "450/374s"]
CELL = ["--prefill-rate", "16Ki/0.31s", "--prompt-tokens", "16Ki"]


def run(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, str(SCRIPTS / "kv-sizing"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def run_json(*args, env=None) -> dict:
    done = run(*args, "--json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def without_modules(tmp_path, *names: str) -> dict:
    """An environment whose Python cannot import ``names`` (a sitecustomize hides them), as the ops
    environment (scripts/requirements.txt) lacks LMCache and torch."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        f"HIDDEN = {set(names)!r}\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in HIDDEN:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
    )
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


# --- the chunk figure ------------------------------------------------------------------------


def test_the_chunk_figure_comes_from_the_geometry():
    # 256 x (78 x 576 + 21 x 132): the MLA latent row of every layer, the DSA indexer row of the 21 layers
    # that run the indexer (GLM-5.3's config: index_topk_freq 4, offset 2; tests/lmcache/test_glm5_chunk_figure.py
    # checks the rule and the rows against vLLM's own code).
    assert (geometry.LATENT_ROW_BYTES, geometry.INDEXER_ROW_BYTES, geometry.FP8_DS_MLA_ROW_BYTES) == (576, 132, 656)
    assert (geometry.LAYERS, geometry.INDEXER_LAYERS) == (78, 21)
    assert geometry.GLM53.indexer_layers == (0, 1, *range(5, 78, 4))
    assert geometry.KV_BYTES_PER_TOKEN == 47_700
    assert geometry.CHUNK_BYTES == 12_211_200
    assert geometry.CHUNK_BYTES / 2**20 == pytest.approx(11.65, abs=0.005)
    assert geometry.FP8_DS_MLA_CHUNK_BYTES == 13_808_640
    assert geometry.LATENT_CHUNK_BYTES == 11_501_568
    # The write-up's 12.4 MB is the whole chunk to within 1.5%, not the latent alone (11.5 MB).
    assert geometry.WRITEUP_CHUNK_BYTES / geometry.CHUNK_BYTES == pytest.approx(1.015, abs=0.001)


def test_the_geometry_of_other_configs():
    glm53 = geometry.GLM53_CONFIG
    # An MTP layer (speculative decoding, not in the presets) adds a latent row and an indexer row.
    assert geometry.from_config(glm53, mtp_layers=1).bytes_per_token == 47_700 + 576 + 132
    # Without index_topk_freq every layer runs the indexer (vLLM's default): the old 78 x (576 + 132).
    every = {k: v for k, v in glm53.items() if k not in ("index_topk_freq", "index_skip_topk_offset")}
    assert geometry.from_config(every).bytes_per_token == 55_224
    # A pattern string: F runs the indexer, S skips; layers past its end run it.
    assert geometry.indexer_layers({**glm53, "num_hidden_layers": 6, "index_topk_pattern": "FSSFS"}) == (0, 3, 5)
    # Not a DSA model (no index_topk): the latent alone.
    assert geometry.from_config({k: v for k, v in glm53.items() if k != "index_topk"}).bytes_per_token == 78 * 576
    with pytest.raises(geometry.ConfigError, match="kv-cache-dtype 'bf16'"):
        geometry.from_config(glm53, "bf16")
    with pytest.raises(geometry.ConfigError, match="num_hidden_layers must be a whole number"):
        geometry.from_config({**glm53, "num_hidden_layers": "78"})


def test_the_default_s_is_the_real_chunk():
    out = run_json(*CELL, "--arrival-rate", "1.2", "--instance-gbps", "1.345")
    assert out["inputs"]["kv_bytes_per_token"] == geometry.KV_BYTES_PER_TOKEN
    assert out["inputs"]["kv_source"] == "78 x 576 + 21 x 132 B: GLM-5.3 FP8 with the presets"
    r = out["results"]
    assert r["prompt_bytes"] == 16384 * 47_700  # 0.782 GB for a 16k prompt
    assert r["break_even_bandwidth"] / GB == pytest.approx(2.521, abs=0.001)
    assert r["per_rank_bytes"] / 1e6 == pytest.approx(97.7, abs=0.05)
    text = run(*CELL, "--arrival-rate", "1.2", "--instance-gbps", "1.345")
    assert "12.21 MB = 11.65 MiB per 256-token chunk" in text.stdout


def _config(folder, **changes):
    """GLM-5.3's config with ``changes`` (None: the key removed), written to ``folder``."""
    folder.mkdir()
    path = folder / "config.json"
    config = {k: v for k, v in {**geometry.GLM53_CONFIG, **changes}.items() if v is not None}
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("flags, per_token", [
    (["--kv-cache-dtype", "fp8_ds_mla"], 78 * 656 + 21 * 132),  # FLASHMLA_SPARSE's fp8_ds_mla rows
    (["--mtp-layers", "1"], 79 * 576 + 22 * 132),  # with an MTP layer, which always has an indexer
    (["--model-config", "{every_layer}"], 78 * (576 + 132)),  # a config without index_topk_freq
    (["--model-config", "{layers_92}", "--kv-cache-dtype", "fp8_ds_mla"], 92 * 656 + 24 * 132),
    (["--kv-row-bytes", "576", "--layers", "78"], 576 * 78),  # a uniform model: the latent alone
    (["--chunk-bytes", "12211200"], 47_700),
    (["--kv-bytes-per-token", "47.7KB"], 47_700),
])
def test_s_from_the_config_rows_chunk_or_per_token(tmp_path, flags, per_token):
    configs = {"{every_layer}": _config(tmp_path / "a", index_topk_freq=None, index_skip_topk_offset=None),
               "{layers_92}": _config(tmp_path / "b", num_hidden_layers=92)}
    out = run_json(*CELL, "--arrival-rate", "1.2", "--instance-gbps", "1.345",
                   *[configs.get(flag, flag) for flag in flags])
    assert out["inputs"]["kv_bytes_per_token"] == pytest.approx(per_token)


# --- the write-up's figures from its own inputs (its 12.4 MB chunk) ------------------------------


def test_writeup_break_even():
    r = model.evaluate(model.Inputs(S, R, 0.9 * GB, N_TOKENS, LAMBDA, shards=1))
    assert S == pytest.approx(48e3, rel=0.01)  # "about 48 KB per token"
    assert R == pytest.approx(53e3, rel=0.01)  # "R ~ 53k tokens/s"
    assert r.break_even_bandwidth / GB == pytest.approx(2.6, abs=0.05)  # "B* ~ 2.6 GB/s"
    assert r.prompt_bytes / GB == pytest.approx(0.8, abs=0.01)  # "a 16k prompt ... about 0.8 GB"
    assert r.recompute_seconds == pytest.approx(0.31)


def test_writeup_one_instance():
    r = model.evaluate(model.Inputs(S, R, 0.9 * GB, N_TOKENS, LAMBDA, shards=1, loading="sync"))
    assert r.load_seconds == pytest.approx(0.9, abs=0.03)  # "about 0.9 s" (0.88 unrounded)
    # "rho ~ 1.07" comes from the rounded 0.8 GB / 0.9 GB/s x 1.20; unrounded 1.06.
    assert r.rho == pytest.approx(1.07, abs=0.015)
    assert r.pod_rho_low == r.pod_rho_high == r.rho  # one pod: its loads never overlap another's
    assert not r.steady_state and not r.hit_pays_off
    assert r.aggregate_bandwidth / r.break_even_bandwidth == pytest.approx(1 / 3, abs=0.03)  # "a third of break-even"


def test_writeup_eight_instances():
    r = model.evaluate(model.Inputs(S, R, 10.76 / 8 * GB, N_TOKENS, LAMBDA, shards=8))
    assert r.aggregate_bandwidth / GB == pytest.approx(10.76)
    assert r.load_seconds == pytest.approx(0.074, abs=0.001)  # "about 74 ms"
    assert r.rho == pytest.approx(0.09, abs=0.005)  # "rho ~ 0.09"
    # the cost model's reference: "the per-rank share (~99 MB)"
    assert r.per_rank_bytes / 1e6 == pytest.approx(99, abs=0.5)
    assert r.steady_state and r.hit_pays_off


def test_cli_text_reproduces_the_writeup():
    one = run(*WRITEUP, "--instance-gbps", "0.9", "--shards", "1", "--loading", "sync")
    assert one.returncode == 0, one.stderr
    assert "break-even bandwidth B* = s*R     2.560 GB/s" in one.stdout
    assert "prompt KV n*s                     0.794 GB  (64 chunks" in one.stdout
    assert "load time T_load = n*s/B          0.882 s" in one.stdout
    assert "NO steady state" in one.stdout
    eight = run(*WRITEUP, "--instance-gbps", "10.76/8s", "--shards", "8")
    assert eight.returncode == 0, eight.stderr
    assert "load time T_load = n*s/B          0.074 s" in eight.stdout
    assert "utilisation rho = lambda*T_load   0.089  (steady state)" in eight.stdout


# --- a cell: P pods sharing the N = W shards -------------------------------------------------


def test_four_pods_share_the_eight_shards():
    # The deployed 4P cell at four times the write-up's rate: rank r of every pod reads shard r.
    i = model.Inputs(geometry.KV_BYTES_PER_TOKEN, R, 1.345 * GB, N_TOKENS, 4 * LAMBDA, shards=8, prefill_pods=4)
    r = model.evaluate(i)
    assert r.per_rank_bytes == N_TOKENS * geometry.KV_BYTES_PER_TOKEN / 8
    assert r.rho == pytest.approx(4 * LAMBDA * N_TOKENS * geometry.KV_BYTES_PER_TOKEN / (8 * 1.345 * GB))
    # Every pod loading at once: 10.76 / 4 GB/s per prompt, 7% above the real chunk's B* (2.521 GB/s).
    assert r.all_pods_bandwidth / GB == pytest.approx(2.69)
    assert r.all_pods_pays_off and r.hit_pays_off
    assert r.all_pods_bandwidth / r.break_even_bandwidth == pytest.approx(1.067, abs=0.001)
    # Async loads share each instance (processor sharing): T_load / (1 - rho) on average.
    assert r.mean_load_seconds == pytest.approx(r.load_seconds / (1 - r.rho))
    assert r.mean_prompt_bandwidth == pytest.approx(r.aggregate_bandwidth * (1 - r.rho))
    assert r.load_within_timeout and r.pod_rho_low is None
    # With the write-up's chunk, the contended bandwidth is "about the break-even 2.56 GB/s".
    w = model.evaluate(model.Inputs(S, R, 1.345 * GB, N_TOKENS, 4 * LAMBDA, shards=8, prefill_pods=4))
    assert w.all_pods_bandwidth / w.break_even_bandwidth == pytest.approx(1.05, abs=0.01)


def test_sync_loading_bounds_the_pods_utilisation():
    i = model.Inputs(geometry.KV_BYTES_PER_TOKEN, R, 1.345 * GB, N_TOKENS, 4.8, shards=8, prefill_pods=4,
                     loading="sync")
    r = model.evaluate(i)
    assert r.pod_rho_low == pytest.approx(4.8 / 4 * r.load_seconds)
    assert r.pod_rho_high == pytest.approx(r.rho)
    assert r.mean_load_seconds is None and r.load_within_timeout is None
    text = run(*CELL, "--arrival-rate", "4.8", "--instance-gbps", "1.345", "--prefill-pods", "4", "--loading", "sync")
    assert text.returncode == 0, text.stderr
    assert f"sync: pod utilisation rho_pod     {r.pod_rho_low:.3f} .. {r.pod_rho_high:.3f}" in text.stdout


def test_async_without_steady_state_times_out():
    r = model.evaluate(model.Inputs(geometry.KV_BYTES_PER_TOKEN, R, 0.9 * GB, N_TOKENS, 1.2, shards=1))
    assert not r.steady_state and r.mean_load_seconds is None and r.load_within_timeout is False


def test_sizing_for_the_target_rho():
    i = model.Inputs(geometry.KV_BYTES_PER_TOKEN, R, 1.345 * GB, 200_000, 2.0, shards=8, prefill_pods=4)
    r = model.evaluate(i)
    at_b = model.evaluate(model.Inputs(i.kv_bytes_per_token, R, r.instance_bandwidth_for_target, 200_000, 2.0,
                                       shards=8, prefill_pods=4))
    assert at_b.rho == pytest.approx(0.5)
    at_rate = model.evaluate(model.Inputs(i.kv_bytes_per_token, R, 1.345 * GB, 200_000,
                                          r.max_arrival_rate_for_target, shards=8, prefill_pods=4))
    assert at_rate.rho == pytest.approx(0.5)


def test_shards_default_to_the_ranks_and_other_counts_warn():
    same = run(*CELL, "--arrival-rate", "1.2", "--instance-gbps", "1.345", "--json")
    assert same.returncode == 0 and same.stderr == ""
    out = json.loads(same.stdout)
    assert out["inputs"]["shards"] == out["inputs"]["ranks"] == 8 and out["warnings"] == []
    other = run(*CELL, "--arrival-rate", "1.2", "--instance-gbps", "1.345", "--shards", "4")
    assert other.returncode == 0
    assert "kv-sizing: warning: 4 instance(s) for 8 ranks: the deployment has one instance per rank" in other.stderr
    more = run_json(*CELL, "--arrival-rate", "1.2", "--instance-gbps", "1.345", "--shards", "16")
    assert more["results"]["aggregate_bandwidth"] == pytest.approx(8 * 1.345 * GB)  # 8 of 16 idle
    assert "8 instance(s) idle" in more["warnings"][0]


def test_cli_json_and_inputs_file(tmp_path):
    inputs = tmp_path / "cell.yaml"
    inputs.write_text("chunk_bytes: 12.4MB\nprefill_rate: 16Ki/0.31s\ninstance_gbps: 1.345\n"
                      "prompt_tokens: 16384\narrival_rate: 1.2\nshards: 8\nprefill_pods: 4\nloading: sync\n")
    out = run_json("--inputs", str(inputs))
    assert out["inputs"]["kv_bytes_per_token"] == pytest.approx(48437.5)
    assert out["inputs"]["prefill_pods"] == 4 and out["inputs"]["loading"] == "sync"
    assert out["results"]["load_seconds"] == pytest.approx(0.0738, abs=0.0005)
    # a flag overrides the file
    assert run_json("--inputs", str(inputs), "--shards", "1")["inputs"]["shards"] == 1


@pytest.mark.parametrize("args, message", [
    (["--prefill-rate", "0"], "prefill_rate: must be > 0"),
    (["--prefill-rate", "-53k"], "prefill_rate: must be > 0"),
    (["--arrival-rate", "0"], "arrival_rate: must be > 0"),
    (["--arrival-rate", "-1.2"], "arrival_rate: must be > 0"),
    (["--instance-gbps", "0"], "instance_gbps: must be > 0"),
    (["--prompt-tokens", "-16Ki"], "prompt_tokens: must be > 0"),
    (["--shards", "0"], "shards: expected an integer >= 1"),
    (["--shards", "2.5"], "shards: expected a whole number"),
    (["--prefill-pods", "0"], "prefill_pods: expected an integer >= 1"),
    (["--ranks", "0"], "ranks: expected an integer >= 1"),
    (["--lookup-timeout", "0"], "lookup_timeout_s: must be > 0"),
    (["--target-rho", "1.5"], "target_rho: must be between 0 and 1"),
    (["--prefill-rate", "fast"], "prefill_rate: 'fast' is not a number"),
    (["--arrival-rate", "450/0s"], "divides by 0 s"),
    (["--kv-bytes-per-token", "48KB"], "give one of kv_bytes_per_token, chunk_bytes, kv_row_bytes"),
    (["--kv-row-bytes", "576,0"], "kv_row_bytes: expected positive byte counts"),
    (["--layers", "78"], "layers: only with kv_row_bytes"),
    (["--kv-cache-dtype", "fp8_ds_mla"], "kv_cache_dtype: only when s comes from the model's config"),
    (["--model-config", "/nonexistent/config.json"], "model_config: /nonexistent/config.json: No such file"),
    (["--mtp-layers", "-1"], "mtp layers must be a whole number >= 0"),
])
def test_bad_input_is_a_clear_error(args, message):
    base = {"--prefill-rate": "53k", "--arrival-rate": "1.2", "--instance-gbps": "0.9", "--prompt-tokens": "16Ki"}
    flags = dict(zip(args[::2], args[1::2], strict=True))
    from_config = {"--kv-row-bytes", "--model-config", "--mtp-layers"} & set(flags)
    argv = [] if from_config else ["--chunk-bytes", "12.4MB"]
    for flag, value in {**base, **flags}.items():
        argv.append(f"{flag}={value}")  # '=' so argparse takes '-53k' as a value
    result = run(*argv)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("kv-sizing: error: ")
    assert message in result.stderr


def test_missing_fields_are_listed(tmp_path):
    result = run("--chunk-bytes", "12.4MB", "--prefill-rate", "53k")
    assert result.returncode == 2
    assert "missing input(s): --instance-gbps, --prompt-tokens, --arrival-rate" in result.stderr
    inputs = tmp_path / "cell.json"
    inputs.write_text(json.dumps({"kv_bytes_per_token": 48437.5, "prefill_rate": 53000}))
    result = run("--inputs", str(inputs))
    assert result.returncode == 2 and "missing input(s): --instance-gbps" in result.stderr
    inputs.write_text(json.dumps({"kv_bytes_per_token": 48437.5, "prefil_rate": 53000}))
    result = run("--inputs", str(inputs))
    assert result.returncode == 2 and "unknown field 'prefil_rate'" in result.stderr


def test_model_rejects_bad_inputs_directly():
    with pytest.raises(model.InputError, match="prefill_rate: must be > 0"):
        model.Inputs(S, 0, GB, N_TOKENS, LAMBDA)
    with pytest.raises(model.InputError, match="arrival_rate: expected a finite number"):
        model.Inputs(S, R, GB, N_TOKENS, float("nan"))
    with pytest.raises(model.InputError, match="loading: expected sync or async"):
        model.Inputs(S, R, GB, N_TOKENS, LAMBDA, loading="lazy")


# --- --measure through valkey-py, from the ops environment ---------------------------------------


def test_the_measurement_opens_a_ranks_connections():
    lmcache = yaml.safe_load((CONFIGS / "prefill" / "lmcache.yaml").read_text())
    assert measure.PRODUCTION_CONNECTIONS == lmcache["extra_config"]["resp_num_threads"] == 32
    assert "--measure-connections" in run("--help").stdout


def test_measure_from_the_ops_environment(valkey, tmp_path):
    """Real-sized GETs over a rank's 32 connections, with LMCache and torch out of reach."""
    client = valkey.client()
    client.config_resetstat()
    before = client.info("stats")["total_connections_received"]
    started = time.monotonic()
    m = run_json("--measure", valkey.url, "--measure-seconds", "0.3", "--measure-keys", "3", "--measure-max-gets",
                 "16", env=without_modules(tmp_path, "lmcache", "torch"))["measurement"]
    elapsed = time.monotonic() - started
    connections = client.info("stats")["total_connections_received"] - before
    commands = client.info("commandstats")
    assert m["client"].startswith("valkey-py ") and m["connections"] == 32
    assert connections == 1 + 32  # one to write the values, then a rank's 32
    assert m["chunk_bytes"] == geometry.CHUNK_BYTES == 12_211_200  # the real chunk by default
    assert 1 <= m["gets"] <= 16 and m["bytes"] == m["gets"] * geometry.CHUNK_BYTES
    assert commands["cmdstat_get"]["calls"] == m["gets"] and commands["cmdstat_set"]["calls"] == 3
    assert m["bandwidth"] == pytest.approx(m["bytes"] / m["seconds"])
    assert m["ms_per_get"] == pytest.approx(geometry.CHUNK_BYTES / m["bandwidth"] * 1e3)
    assert 0 < m["get_p50_ms"] <= m["get_p99_ms"] <= m["seconds"] * 1e3
    assert m["server_usec_per_get"] == pytest.approx(commands["cmdstat_get"]["usec_per_call"], rel=0.01)
    assert 0 < m["client_cpu_cores"] and 1 <= m["client_processes"] <= m["usable_cores"]
    assert m["round_p50_ms"] is None  # rounds are the LMCache client's
    assert client.dbsize() == 0  # its values are deleted afterwards
    assert elapsed < 30
    print(f"kv-sizing --measure (valkey-py) against a local Valkey: {m['bandwidth'] / GB:.3f} GB/s, "
          f"{m['ms_per_get']:.1f} ms per GET of {m['chunk_bytes']:,} B ({m['gets']} GETs; p50 "
          f"{m['get_p50_ms']:.0f} ms with 32 in flight; server {m['server_usec_per_get'] / 1e3:.1f} ms per GET; "
          f"client {m['client_cpu_cores']:.2f} cores in {m['client_processes']} processes)")


def test_measure_every_instance_and_size_with_the_slowest(valkey, tmp_path):
    second = start_valkey(tmp_path)
    try:
        out = run_json("--measure", valkey.url, "--measure", second.url, "--measure-seconds", "0.2",
                       "--measure-keys", "2", "--measure-connections", "4", "--measure-max-gets", "8",
                       *CELL, "--arrival-rate", "1.2", "--prefill-pods", "4")
    finally:
        second.stop()
    assert [m["url"] for m in out["measurements"]] == [valkey.url, second.url]
    assert all(1 <= m["gets"] <= 8 and m["connections"] == 4 for m in out["measurements"])
    slowest = min(out["measurements"], key=lambda m: m["bandwidth"])
    assert out["measurement"] == slowest
    assert out["inputs"]["instance_bandwidth"] == pytest.approx(slowest["bandwidth"])
    assert out["results"]["aggregate_bandwidth"] == pytest.approx(8 * slowest["bandwidth"])


def test_a_template_means_every_instance():
    template = "resp://valkey-lmcache-{rank}.vllm.svc.cluster.local:6379"
    assert measure.expand_urls([template], 3) == [template.replace("{rank}", str(r)) for r in range(3)]
    assert measure.expand_urls(["resp://a:1", "resp://b:2"], 8) == ["resp://a:1", "resp://b:2"]
    with pytest.raises(ValueError, match="expected resp://HOST:PORT"):
        measure.expand_urls(["http://a:1"], 1)


def test_measure_uses_the_configured_chunk_size(valkey):
    out = run_json("--measure", valkey.url, "--measure-seconds", "0.2", "--measure-keys", "2",
                   "--kv-bytes-per-token", "4KB", "--chunk-tokens", "16")
    assert out["measurement"]["chunk_bytes"] == 64_000
    assert out["measurement"]["ms_per_get"] == pytest.approx(64_000 / out["measurement"]["bandwidth"] * 1e3)


def test_measure_text_reports_time_per_get_and_a_client_bound_result():
    m = measure.Measurement(
        url="resp://h:1", client="c", chunk_bytes=12_211_200, keys=1, connections=32, gets=1, bytes=1, seconds=1.0,
        bandwidth=1.2e9, ms_per_get=10.176, get_p50_ms=300.0, get_p99_ms=320.0, round_p50_ms=None,
        round_p99_ms=None, server_usec_per_get=2500.0, client_cpu_seconds=1.9, client_cpu_cores=1.9,
        usable_cores=2, client_processes=2, client_bound=True)
    text = cli.measurement_text(m)
    assert "1.200 GB/s per instance, 10.18 ms per GET of 12.21 MB" in text
    assert "p50 300.0 ms, p99 320.0 ms; the server's time per GET 2.50 ms" in text
    assert "CLIENT-BOUND: the client used 1.90 cores in 2 process(es) of 2 usable" in text
    assert measure.client_bound(0.9, 1) and not measure.client_bound(0.5, 1)


def test_measure_errors(tmp_path):
    port = free_loopback_port()
    refused = run("--measure", f"resp://127.0.0.1:{port}", "--measure-seconds", "0.2")
    assert refused.returncode == 3
    assert "measurement failed: cannot connect to 127.0.0.1" in refused.stderr
    too_long = run("--measure", f"resp://127.0.0.1:{port}", "--measure-seconds", "600")
    assert too_long.returncode == 2 and "seconds: expected" in too_long.stderr
    both = run("--measure", f"resp://127.0.0.1:{port}", *WRITEUP, "--instance-gbps", "1")
    assert both.returncode == 2 and "not both" in both.stderr
    scheme = run("--measure", "http://127.0.0.1:1")
    assert scheme.returncode == 2 and "expected resp://HOST:PORT" in scheme.stderr
    small = start_valkey(tmp_path, ["--maxmemory", "30mb", "--maxmemory-policy", "allkeys-lru"])
    try:  # three 12.2 MB values in 30 MB: the third evicts one written before
        evicted = run("--measure", small.url, "--measure-seconds", "0.2", "--measure-keys", "3",
                      "--measure-connections", "2")
    finally:
        small.stop()
    assert evicted.returncode == 3 and "vanished during the measurement (evicted?" in evicted.stderr


# --- --measure-client lmcache: LMCache's native RESP client against a real Valkey ---------------------


def test_the_lmcache_client_says_what_it_needs(tmp_path):
    assert "needs LMCache 0.5.5 with its C++ extension (lmcache.lmcache_redis) and torch" in \
        " ".join(run("--help").stdout.split())
    missing = run("--measure-client", "lmcache", "--measure", "resp://127.0.0.1:1",
                  env=without_modules(tmp_path, "lmcache", "torch"))
    assert missing.returncode == 2 and missing.stdout == ""
    assert len(missing.stderr.splitlines()) == 1, missing.stderr
    assert missing.stderr.startswith("kv-sizing: error: --measure-client lmcache needs LMCache 0.5.5")
    assert "and torch" in missing.stderr and "--measure-client valkey-py" in missing.stderr
    several = run("--measure-client", "lmcache", "--measure", "resp://valkey-lmcache-{rank}.svc:6379")
    assert several.returncode == 2 and "one instance per run" in several.stderr


def test_measure_through_lmcaches_native_client(valkey):
    # The GETs arrive from the native client's worker connections, after a probe connection.
    client = valkey.client()
    client.config_resetstat()
    started = time.monotonic()
    out = run_json("--measure-client", "lmcache", "--measure", valkey.url, "--measure-seconds", "0.3",
                   "--measure-keys", "2", "--measure-connections", "5", *CELL, "--arrival-rate", "1.2")
    elapsed = time.monotonic() - started
    stats = client.info("stats")
    commands = client.info("commandstats")
    m = out["measurement"]
    assert m["client"] == "LMCache native RESP client (lmcache_redis), 5 workers" and m["connections"] == 5
    assert stats["total_connections_received"] >= 1 + 5  # the probe, then the native client's 5 workers
    assert commands["cmdstat_get"]["calls"] == m["gets"] and commands["cmdstat_set"]["calls"] == 2
    assert m["chunk_bytes"] == geometry.CHUNK_BYTES  # the real chunk by default
    assert m["gets"] >= 2 and m["gets"] % 2 == 0 and m["bytes"] == m["gets"] * geometry.CHUNK_BYTES
    assert m["bandwidth"] == pytest.approx(m["bytes"] / m["seconds"])
    assert m["ms_per_get"] == pytest.approx(geometry.CHUNK_BYTES / m["bandwidth"] * 1e3)
    assert 0 < m["round_p50_ms"] <= m["round_p99_ms"]
    # The client's CPU over the loads: it did work, at most every usable core.
    assert 0 < m["client_cpu_seconds"] and 0 < m["client_cpu_cores"] <= m["usable_cores"] * 1.05
    assert m["client_bound"] == (m["client_cpu_cores"] >= 0.8 * m["usable_cores"])
    assert out["inputs"]["instance_bandwidth"] == pytest.approx(m["bandwidth"])  # b of the model
    assert elapsed < 90  # short and bounded (most of it is importing torch and LMCache)
    assert client.dbsize() == 0  # its keys are deleted afterwards


# --- bad --inputs files ------------------------------------------------------------------------


def test_an_inputs_file_that_is_not_utf8_is_named(tmp_path):
    inputs = tmp_path / "cell.yaml"
    inputs.write_bytes("prefill_rate: 53k\nnote: caf\u00e9\n".encode("latin-1"))
    done = run("--inputs", str(inputs))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"kv-sizing: error: --inputs {inputs}: not UTF-8 text (byte 0xe9 at offset 27)\n"


def test_yaml_inputs_without_pyyaml_say_so(tmp_path):
    inputs = tmp_path / "cell.yaml"
    inputs.write_text("chunk_bytes: 12.4MB\nprefill_rate: 16Ki/0.31s\ninstance_gbps: 1.345\n"
                      "prompt_tokens: 16384\narrival_rate: 1.2\n")
    assert run_json("--inputs", str(inputs))["inputs"]["prefill_rate"] == pytest.approx(16384 / 0.31)
    done = run("--inputs", str(inputs), env=without_modules(tmp_path, "yaml"))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert f"--inputs {inputs}: reading YAML needs PyYAML, which this Python cannot import" in done.stderr
    assert "not valid YAML" not in done.stderr
    requirements = (SCRIPTS / "requirements.txt").read_text().splitlines()
    assert any(line.startswith("PyYAML==") for line in requirements)  # the ops environment has it


def test_an_inputs_file_that_is_not_yaml_is_one_line(tmp_path):
    inputs = tmp_path / "cell.yaml"
    inputs.write_text("prefill_rate: [53k\narrival_rate: 1.2\n")
    done = run("--inputs", str(inputs))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith(f"kv-sizing: error: --inputs {inputs}: not valid YAML: ")
