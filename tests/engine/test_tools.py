"""The operator tools against the real engine: replay, valkey-stats, needle.

The shared prefill engine (shared.py: configs/prefill on the CPU overlay,
with ``--enable-prompt-tokens-details`` so ``cached_tokens`` is the server's
own count, and the tiny checkpoint with a character-level tokenizer: the
tools write English, which the word tokenizer reads as ``<unk>``
throughout). The tools run as an operator runs them: the scripts, as
processes, against the server's URL and its Valkey.

* replay: a generated stream with reuse, run twice (the second pass after
  L1 is emptied, so it is served from Valkey); TTFT percentiles and thirds
  come from the real server, and ``cached_tokens`` matches what the stream's
  reuse and LMCache's own log say.
* valkey-stats samples the engine's Valkey under the second pass: its GET
  count is exactly Valkey's own commandstats delta.
* needle, through its four phases with a real restart behind the same URL:
  with random weights no answer holds the code (that check cannot pass
  here), so what is checked is the tool's phase and evidence logic: l1 and l2
  judged served by the connector's hit counter and ``cached_tokens``, the
  cold phases not, and the exit status naming the missing codes only.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.engine.conftest import REPO
from tests.engine.prompts import CHUNK
from tests.support.engine import command_calls

TOOL_TIMEOUT_S = 300
LENGTH = 1100   # needle's prompt: four full chunks and a tail


def _tool(name: str, *args: str, timeout: float = TOOL_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.engine
def test_replay_and_valkey_stats(shared_prefill, tmp_path):
    engine, valkey = shared_prefill, shared_prefill.valkey
    url = engine.server.url
    generated = _tool("replay", "generate", "--count", "9", "--rate", "1", "--seed", "5", "--reuse-share", "0.5",
                      "--min-tokens", "300", "--max-tokens", "1100", "--output-tokens", "2",
                      "--tokenize-url", url, "--out", str(tmp_path / "stream"))
    assert generated.returncode == 0, generated.stderr
    stream = [json.loads(line) for line in (tmp_path / "stream" / "stream.jsonl").read_text().splitlines()]
    reusing = {r["id"] for r in stream if "reuses" in r}
    assert reusing and len(reusing) < len(stream), stream

    def run_pass(name: str) -> tuple[list[dict[str, str]], dict]:
        out = tmp_path / name
        # The write-up's TTFT gates are for the B300 cell, not a tiny model on 2 shared cores.
        done = _tool("replay", "run", str(tmp_path / "stream" / "stream.jsonl"), "--url", url, "--out", str(out),
                     "--gate-p90", "off", "--gate-p50", "off", "--gate-mean", "off")
        assert done.returncode == 0, (f"replay {name}: exit {done.returncode}\n"
                                      f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
        rows, summary = _rows(out / "records.csv"), json.loads((out / "summary.json").read_text())["summary"]
        assert [r["status"] for r in rows] == ["ok"] * len(stream), [(r["id"], r["status"], r["error"]) for r in rows]
        thirds = summary["ttft_thirds"]
        assert list(thirds) == ["first third", "second third", "last third"]
        assert sum(t["count"] for t in thirds.values()) == summary["ttft"]["count"] == len(stream)
        ttfts = sorted(float(r["ttft_s"]) for r in rows)
        assert ttfts[0] > 0 and summary["ttft"]["min"] == pytest.approx(ttfts[0], abs=1e-3)
        assert summary["ttft"]["max"] == pytest.approx(ttfts[-1], abs=1e-3)
        print(f"replay {name}: TTFT p50 {summary['ttft']['p50']:.3f} s, p90 {summary['ttft']['p90']:.3f} s, "
              f"p99 {summary['ttft']['p99']:.3f} s; thirds p50 "
              + ", ".join("-" if t["p50"] is None else f"{t['p50']:.3f}" for t in thirds.values())
              + " s; cached tokens "
              + str(sum(int(r["cached_tokens"] or 0) for r in rows)))
        return rows, summary

    mark = engine.server.log_mark()
    first, _ = run_pass("pass1")
    counts = engine.server.lmcache_counts(mark)
    # Pass 1: fresh prompts are salted, so only a reusing request can be served, and
    # LMCache's own retrieved count is what the server reports as cached.
    assert all(int(r["cached_tokens"]) == 0 for r in first if r["id"] not in reusing), first
    cached = sum(int(r["cached_tokens"]) for r in first)
    assert cached == counts.retrieved, (cached, counts.retrieved, counts.lines[-8:])
    assert counts.stored > 0

    # Pass 2 from Valkey: L1 emptied; valkey-stats samples the instance meanwhile.
    engine.clear_l1()
    stats_out = tmp_path / "valkey-stats"
    before = command_calls(valkey)
    sampler = subprocess.Popen([sys.executable, str(REPO / "scripts/valkey-stats"), "--url", valkey.url,
                                "--interval", "1", "--out", str(stats_out), "--no-plots"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    lines = _Output(sampler.stderr)   # its interval lines go to stderr
    try:
        # An interval line is printed once a sample after the baseline is in: the
        # load starts after it, and ends before the next one.
        lines.wait_for("GET/s all shards", sampler, TOOL_TIMEOUT_S)
        mark = engine.server.log_mark()
        second, _ = run_pass("pass2")
        counts = engine.server.lmcache_counts(mark)
        seen = lines.text.count("GET/s all shards")
        lines.wait_for("GET/s all shards", sampler, TOOL_TIMEOUT_S, count=seen + 1)
    finally:
        sampler.terminate()
        sampler.wait(timeout=60)
    after = command_calls(valkey)
    out = sampler.stdout.read().decode(errors="replace")
    assert sampler.returncode == 0, f"valkey-stats exit {sampler.returncode}\n{out[-2000:]}{lines.join()[-2000:]}"
    for row in second:
        tokens = int(row["prompt_tokens"])
        assert int(row["cached_tokens"]) >= tokens - CHUNK, f"{row['id']}: {row['cached_tokens']} of {tokens} cached"
    assert sum(int(r["cached_tokens"]) for r in second) == counts.retrieved
    gets = after.get("get", 0) - before.get("get", 0)
    intervals = _rows(stats_out / "intervals.csv")
    sampled = sum(int(r["get_calls"] or 0) for r in intervals)
    assert gets > 0 and sampled == gets, f"valkey-stats counted {sampled} GETs, Valkey's commandstats {gets}"
    print(f"valkey-stats: {len(intervals)} intervals, {sampled} GETs (commandstats {gets}); "
          f"summary {(stats_out / 'summary.json').read_text()[:600]}")


class _Output:
    """Reads a process's output as it comes (needle's restart prompt ends without a newline)."""

    def __init__(self, stream):
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        while chunk := os.read(stream.fileno(), 4096):
            self.text += chunk.decode(errors="replace")

    def wait_for(self, text: str, process: subprocess.Popen, timeout_s: float, count: int = 1) -> None:
        deadline = time.monotonic() + timeout_s
        while self.text.count(text) < count:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} (#{count}) from {process.args[1]}:\n{self.text[-3000:]}")
            time.sleep(0.2)

    def join(self) -> str:
        self._thread.join(timeout=10)
        return self.text


@pytest.mark.engine
def test_needle_phases_and_evidence(shared_prefill, tmp_path):
    engine, valkey = shared_prefill, shared_prefill.valkey
    out = tmp_path / "needle"
    process = subprocess.Popen(
        [sys.executable, str(REPO / "scripts/needle"), "--url", engine.server.url, "--lengths", str(LENGTH),
         "--seed", "3", "--max-answer-tokens", "4", "--restart-timeout", "120", "--request-timeout", "120",
         "--out", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    stderr = _Output(process.stderr)
    try:
        stderr.wait_for("press Enter when restarted>", process, TOOL_TIMEOUT_S)
        engine.restart()   # the same URL: the tool waits for /health, then asks from L2
        before = command_calls(valkey)
        process.stdin.write(b"\n")
        process.stdin.close()
        process.wait(timeout=TOOL_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    text = stderr.join()
    rows = {r["phase"]: r for r in _rows(out / "results.csv")}
    assert list(rows) == ["cold", "l1", "l2", "cold-again"], text[-3000:]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    tokens = int(rows["cold"]["prompt_tokens"])
    # fitted with the server's /tokenize (one token per character: the closest reachable length)
    assert abs(tokens - LENGTH) <= 8 and all(int(r["prompt_tokens"]) == tokens for r in rows.values()), rows
    # Evidence: the connector's hit counter and the server's cached_tokens agree, per phase.
    for phase in ("l1", "l2"):
        row = rows[phase]
        assert row["served_from_cache"] == "yes", row
        assert (int(row["connector_hits"]) >= tokens - CHUNK
                and int(row["cached_tokens"]) == int(row["connector_hits"])), row
    for phase in ("cold", "cold-again"):
        row = rows[phase]
        assert int(row["cached_tokens"]) == 0 and int(row["connector_hits"] or 0) == 0, row
        assert row["served_from_cache"] == "", row
    gets = command_calls(valkey).get("get", 0) - before.get("get", 0)
    assert gets == int(rows["l2"]["cached_tokens"]) // CHUNK, f"{gets} GETs for phase l2 (and cold-again)"
    # Both cache-served answers are the same (the cold ones differ from them, see test_protocol.py).
    assert rows["l1"]["answer"] == rows["l2"]["answer"], rows
    # Random weights: no answer holds the code; the tool exits 1 for that, not for evidence.
    assert all(r["found"] == "no" for r in rows.values()), rows
    assert process.returncode == 1, text[-3000:]
    assert "NOT SERVED FROM CACHE" not in text, text[-3000:]
    print("needle TTFT: " + ", ".join(f"{p} {float(r['ttft_s']):.3f} s (cached {r['cached_tokens']})"
                                      for p, r in rows.items()))
