"""kv-sizing: the write-up's cost model reproduced from its inputs, bad input, and --measure on real Valkey."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.configs.support import SCRIPTS, load_kvsizing

kvsizing = load_kvsizing()
model = kvsizing.model
GB = 1e9

# The write-up's inputs: 12.4 MB per 256-token chunk; a 16k (16,384-token)
# prompt prefilled in 0.31 s; hit-heavy replay 450 requests in 374 s.
S = 12.4e6 / 256
R = 16384 / 0.31
N_TOKENS = 16384
LAMBDA = 450 / 374

WRITEUP = ["--chunk-bytes", "12.4MB", "--chunk-tokens", "256", "--prefill-rate", "16Ki/0.31s",
           "--prompt-tokens", "16Ki", "--arrival-rate", "450/374s"]


def run(*args, timeout=60):
    return subprocess.run([sys.executable, str(SCRIPTS / "kv-sizing"), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_writeup_break_even():
    r = model.evaluate(model.Inputs(S, R, 0.9 * GB, N_TOKENS, LAMBDA))
    assert S == pytest.approx(48e3, rel=0.01)  # "about 48 KB per token"
    assert R == pytest.approx(53e3, rel=0.01)  # "R ~ 53k tokens/s"
    assert r.break_even_bandwidth / GB == pytest.approx(2.6, abs=0.05)  # "B* ~ 2.6 GB/s"
    assert r.prompt_bytes / GB == pytest.approx(0.8, abs=0.01)  # "a 16k prompt ... about 0.8 GB"
    assert r.recompute_seconds == pytest.approx(0.31)


def test_writeup_one_instance():
    r = model.evaluate(model.Inputs(S, R, 0.9 * GB, N_TOKENS, LAMBDA, shards=1))
    assert r.load_seconds == pytest.approx(0.9, abs=0.03)  # "about 0.9 s" (0.88 unrounded)
    # "rho ~ 1.07" comes from the rounded 0.8 GB / 0.9 GB/s x 1.20; unrounded 1.06.
    assert r.rho == pytest.approx(1.07, abs=0.015)
    assert not r.steady_state and not r.hit_pays_off
    assert r.aggregate_bandwidth / r.break_even_bandwidth == pytest.approx(1 / 3, abs=0.03)  # "a third of break-even"


def test_writeup_eight_instances():
    r = model.evaluate(model.Inputs(S, R, 10.76 / 8 * GB, N_TOKENS, LAMBDA, shards=8))
    assert r.aggregate_bandwidth / GB == pytest.approx(10.76)
    assert r.load_seconds == pytest.approx(0.074, abs=0.001)  # "about 74 ms"
    assert r.rho == pytest.approx(0.09, abs=0.005)  # "rho ~ 0.09"
    assert r.steady_state and r.hit_pays_off


def test_smallest_shard_count_keeps_the_target():
    i = model.Inputs(S, R, 0.9 * GB, N_TOKENS, LAMBDA, target_rho=0.5)
    n = model.evaluate(i).shards_for_target_rho
    rho = lambda shards: model.evaluate(model.Inputs(S, R, 0.9 * GB, N_TOKENS, LAMBDA, shards=shards)).rho  # noqa: E731
    assert rho(n) <= 0.5 < rho(n - 1)
    b = model.evaluate(i).shards_for_break_even
    assert b * 0.9 * GB > model.evaluate(i).break_even_bandwidth >= (b - 1) * 0.9 * GB


def test_cli_text_reproduces_the_writeup():
    one = run(*WRITEUP, "--instance-gbps", "0.9")
    assert one.returncode == 0, one.stderr
    assert "break-even bandwidth B* = s*R     2.560 GB/s" in one.stdout
    assert "prompt KV n*s                     0.794 GB  (64 chunks" in one.stdout
    assert "load time T_load = n*s/B          0.882 s" in one.stdout
    assert "NO steady state" in one.stdout
    eight = run(*WRITEUP, "--instance-gbps", "10.76/8s", "--shards", "8")
    assert eight.returncode == 0, eight.stderr
    assert "load time T_load = n*s/B          0.074 s" in eight.stdout
    assert "utilisation rho = lambda*T_load   0.089  (steady state)" in eight.stdout


def test_cli_json_and_inputs_file(tmp_path):
    inputs = tmp_path / "cell.yaml"
    inputs.write_text("chunk_bytes: 12.4MB\nprefill_rate: 16Ki/0.31s\ninstance_gbps: 1.345\n"
                      "prompt_tokens: 16384\narrival_rate: 1.2\nshards: 8\n")
    result = run("--inputs", str(inputs), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["inputs"]["kv_bytes_per_token"] == pytest.approx(48437.5)
    assert out["results"]["load_seconds"] == pytest.approx(0.0738, abs=0.0005)
    # a flag overrides the file
    result = run("--inputs", str(inputs), "--shards", "1", "--json")
    assert json.loads(result.stdout)["inputs"]["shards"] == 1


@pytest.mark.parametrize("args, message", [
    (["--prefill-rate", "0"], "prefill_rate: must be > 0"),
    (["--prefill-rate", "-53k"], "prefill_rate: must be > 0"),
    (["--arrival-rate", "0"], "arrival_rate: must be > 0"),
    (["--arrival-rate", "-1.2"], "arrival_rate: must be > 0"),
    (["--instance-gbps", "0"], "instance_gbps: must be > 0"),
    (["--prompt-tokens", "-16Ki"], "prompt_tokens: must be > 0"),
    (["--shards", "0"], "shards: expected an integer >= 1"),
    (["--shards", "2.5"], "shards: expected a whole number"),
    (["--target-rho", "1.5"], "target_rho: must be between 0 and 1"),
    (["--prefill-rate", "fast"], "prefill_rate: 'fast' is not a number"),
    (["--arrival-rate", "450/0s"], "divides by 0 s"),
    (["--kv-bytes-per-token", "48KB"], "either kv_bytes_per_token or chunk_bytes"),
])
def test_bad_input_is_a_clear_error(args, message):
    base = {"--prefill-rate": "53k", "--arrival-rate": "1.2", "--instance-gbps": "0.9", "--prompt-tokens": "16Ki"}
    flags = dict(zip(args[::2], args[1::2], strict=True))
    argv = ["--chunk-bytes", "12.4MB"]
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


# --- --measure against a real Valkey -------------------------------------------------------


def test_measure_against_real_valkey(valkey):
    started = time.monotonic()
    result = run("--measure", valkey.url, "--measure-seconds", "0.5", "--measure-keys", "4", "--json")
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    m = json.loads(result.stdout)["measurement"]
    assert m["chunk_bytes"] == 12_400_000  # the real chunk size by default
    assert m["gets"] >= 1 and m["bytes"] == m["gets"] * 12_400_000
    assert m["bandwidth"] > 0 and m["server"].startswith("valkey 8.1")
    assert elapsed < 30  # short and bounded
    assert valkey.client().dbsize() == 0  # its keys are deleted afterwards


def test_measure_feeds_the_model(valkey):
    result = run("--measure", valkey.url, "--measure-seconds", "0.3", "--measure-max-gets", "20",
                 "--chunk-bytes", "12.4MB", "--prefill-rate", "53k", "--prompt-tokens", "16Ki",
                 "--arrival-rate", "1.2", "--shards", "8", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["measurement"]["gets"] <= 20
    assert out["inputs"]["instance_bandwidth"] == pytest.approx(out["measurement"]["bandwidth"])
    assert out["results"]["aggregate_bandwidth"] == pytest.approx(8 * out["measurement"]["bandwidth"])


def test_measure_uses_the_configured_chunk_size(valkey):
    result = run("--measure", valkey.url, "--measure-seconds", "0.2", "--kv-bytes-per-token", "4KB",
                 "--chunk-tokens", "16", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["measurement"]["chunk_bytes"] == 64_000


def test_measure_errors(tmp_path):
    from tests.support.valkey import free_loopback_port

    port = free_loopback_port()
    refused = run("--measure", f"resp://127.0.0.1:{port}", "--measure-seconds", "0.2")
    assert refused.returncode == 3
    assert "measurement failed: cannot connect to 127.0.0.1" in refused.stderr
    template = run("--measure", "resp://valkey-lmcache-{rank}.vllm.svc.cluster.local:6379")
    assert template.returncode == 2 and "a template" in template.stderr
    too_long = run("--measure", f"resp://127.0.0.1:{port}", "--measure-seconds", "600")
    assert too_long.returncode == 2 and "seconds: expected" in too_long.stderr
    both = run("--measure", f"resp://127.0.0.1:{port}", *WRITEUP, "--instance-gbps", "1")
    assert both.returncode == 2 and "not both" in both.stderr
