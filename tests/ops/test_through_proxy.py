"""Replay and needle through vLLM's real P/D toy proxy (from the pinned sdist), as in the cell.

Two fake engines stand in for a prefill and a decode engine (see
fake_engine.py: the prefill answers the proxy's ``stream: false`` call with
``kv_transfer_params``, the decode counts the whole prompt as transferred);
the proxy is vLLM's own script, run as a process. It relays the decode
engine's event stream with ``Content-Type: application/json``. The proxy's
imports (fastapi, httpx, uvicorn) are LMCache's own requirements, so the test
venv has them.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
from opstools import needle_cli, replay_cli

from tests.ops.fake_engine import FakeEngine
from tests.ops.toy_proxy import start_toy_proxy, toy_proxy_source
from tests.support.ports import free_loopback_port


@pytest.fixture
def cell(tmp_path):
    try:
        script = toy_proxy_source(tmp_path)
    except FileNotFoundError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{exc} (CI=true: make test's setup fetches it)", pytrace=False)
        pytest.skip(str(exc))
    prefill = FakeEngine(decode_gap=0.01).start()
    decode = FakeEngine(decode_gap=0.01).start()
    proxy = start_toy_proxy(script, free_loopback_port(), prefill.port, decode.port, tmp_path / "proxy.log")
    try:
        yield proxy, prefill, decode
    finally:
        proxy.stop()
        prefill.stop()
        decode.stop()


def test_replay_through_the_toy_proxy_measures_every_request(cell, tmp_path, capsys):
    proxy, prefill, decode = cell
    stream = tmp_path / "stream.jsonl"
    with stream.open("w") as handle:
        for i in range(6):
            words = " ".join(f"w{i}x{j}" for j in range(600))
            handle.write(json.dumps({"id": f"r{i}", "offset_s": 0.15 * i, "prompt": words, "max_tokens": 4}) + "\n")
    out = tmp_path / "out"
    code = replay_cli.main(["run", str(stream), "--url", proxy.url, "--model", "fake-glm", "--out", str(out),
                            "--quiet"])
    captured = capsys.readouterr()
    with (out / "records.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    # a reader that insists on text/event-stream marks the first malformed and stops the run
    assert [r["status"] for r in rows] == ["ok"] * 6, [r["error"] for r in rows]
    assert code == 0, captured.err
    assert all(float(r["ttft_s"]) > 0 and r["completion_tokens"] == "4" for r in rows)
    assert captured.err.count("not text/event-stream; reading it as an event stream") == 1
    # the proxy's two calls per request: a non-streamed prefill, then the decode with the KV transfer params
    assert [a.body["stream"] for a in prefill.arrivals] == [False] * 6
    assert {a.body["max_tokens"] for a in prefill.arrivals} == {1}
    assert all(a.body["kv_transfer_params"]["do_remote_prefill"] for a in decode.arrivals)
    assert "TTFT measured: 6 with TTFT / 6 ok" in captured.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "PASS"
    assert summary["summary"]["throughput"]["output_tokens_per_s"] > 1


def test_replay_through_the_proxy_without_a_model_says_to_pass_one(cell, tmp_path, capsys):
    proxy, _, _ = cell
    stream = tmp_path / "stream.jsonl"
    stream.write_text('{"offset_s": 0, "prompt": "a b c", "max_tokens": 1}\n')
    code = replay_cli.main(["run", str(stream), "--url", proxy.url, "--out", str(tmp_path / "o"), "--quiet"])
    assert code == 2
    assert "answered HTTP 404; pass --model" in capsys.readouterr().err


def needle_through(proxy, prefill, out: Path, *extra: str) -> int:
    return needle_cli.main(["--url", proxy.url, "--engine-url", prefill.url, "--lengths", "2000,5000",
                            "--seed", "2", "--skip-restart", "--out", str(out), *extra])


def results(out: Path) -> list[dict[str, str]]:
    with (out / "results.csv").open() as handle:
        return list(csv.DictReader(handle))


def test_needle_through_the_toy_proxy_finds_every_code_served_from_the_prefill_cache(cell, tmp_path):
    proxy, prefill, _ = cell
    out = tmp_path / "out"
    assert needle_through(proxy, prefill, out) == 0
    rows = results(out)
    assert [r["phase"] for r in rows] == ["cold", "cold", "l1", "l1", "cold-again", "cold-again"]
    assert all(r["found"] == "yes" for r in rows)
    for row in rows:
        hits = int(row["connector_hits"])  # the prefill engine's counter
        if row["phase"] == "l1":
            assert row["served_from_cache"] == "yes" and hits >= int(row["length"]) - 256
        else:
            assert hits == 0


def test_needle_through_the_proxy_fails_when_the_prefill_cache_did_not_serve(cell, tmp_path, capsys):
    proxy, prefill, _ = cell
    prefill.cache_serves = False
    out = tmp_path / "out"
    assert needle_through(proxy, prefill, out, "--metrics-url", prefill.url) == 1
    l1 = [r for r in results(out) if r["phase"] == "l1"]
    assert [r["found"] for r in l1] == ["yes", "yes"]  # recomputed: the code alone proves nothing
    assert [r["served_from_cache"] for r in l1] == ["no", "no"]
    # through the proxy usage carries the prefill's own count (vLLM 0.31.0's remote_prefill_cached_tokens):
    # 0 here, while the decode engine's counter took NIXL's whole transfer as external hits
    assert all(int(r["cached_tokens"]) == 0 for r in l1)
    assert "the KV connector served 0 of 2000 tokens" in l1[0]["evidence"]
    assert "2 cached-phase answer(s) not served from cache" in capsys.readouterr().err
