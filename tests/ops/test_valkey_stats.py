"""The Valkey stats sampler against real Valkey 8.1 servers under a GET load the test sends."""
from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from opstools import valkey_cli
from opstools.common import OpsError
from opstools.valkey_sampler import (
    Sampler,
    ServerSample,
    expand_targets,
    interval_between,
    parse_shard_url,
    sample_from_info,
)

from tests.support.valkey import free_loopback_port, start_valkey

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def two_shards(valkey, tmp_path):
    second = start_valkey(tmp_path)
    try:
        yield [valkey, second]
    finally:
        second.stop()


def loaded_clients(servers):
    """Clients that have connected already (their handshake is not part of the load)."""
    clients = [s.client() for s in servers]
    for client in clients:
        client.set("k", b"v" * 1024)
    return clients


def send_gets(client, count: int) -> None:
    for _ in range(count):
        client.get("k")


def test_template_list_and_url_forms():
    targets = expand_targets("resp://valkey-lmcache-{rank}.svc:6379", 3, [])
    assert [(t.rank, t.host, t.port) for t in targets] == [(0, "valkey-lmcache-0.svc", 6379),
                                                          (1, "valkey-lmcache-1.svc", 6379),
                                                          (2, "valkey-lmcache-2.svc", 6379)]
    listed = expand_targets(None, None, ["redis://a:1,valkey://b:2", "c"])
    assert [(t.host, t.port) for t in listed] == [("a", 1), ("b", 2), ("c", 6379)]
    secured = parse_shard_url("rediss://user:p%40ss@h:7000/2", 0)
    assert (secured.username, secured.password, secured.db, secured.tls) == ("user", "p@ss", 2, True)
    for template, shards, urls, message in [
        ("resp://v:6379", 2, [], "no '{rank}'"),
        ("resp://v-{rank}:6379", None, [], "needs --shards"),
        ("resp://v-{rank}:6379", 2, ["resp://x"], "not both"),
        (None, None, [], "no shard to sample"),
        (None, None, ["http://x:1"], "unknown scheme"),
        (None, None, ["resp://x:notaport"], "bad port"),
    ]:
        with pytest.raises(OpsError, match=message):
            expand_targets(template, shards, urls)


def test_cpu_comes_from_the_main_thread_when_reported():
    info = {"cmdstat_get": {"calls": 10, "usec": 50}, "cmdstat_set": {"calls": 3, "usec": 9},
            "cmdstat_info": {"calls": 99, "usec": 1}, "used_cpu_user": 9.0, "used_cpu_sys": 9.0,
            "used_cpu_user_main_thread": 1.5, "used_cpu_sys_main_thread": 0.5}
    sample = sample_from_info(info, 1.0, 0.0)
    assert (sample.get_calls, sample.get_usec, sample.other_calls) == (10, 50, 3)
    assert (sample.cpu_s, sample.cpu_source) == (2.0, "main_thread")
    old_server = {k: v for k, v in info.items() if "main_thread" not in k}
    assert sample_from_info(old_server, 1.0, 0.0).cpu_source == "process"


def test_interval_figures_and_counter_reset():
    target = parse_shard_url("resp://h:1", 0)
    before = ServerSample(0.0, 0.0, get_calls=100, get_usec=1_000, other_calls=0, cpu_s=1.0, cpu_source="main_thread")
    after = ServerSample(2.0, 2.0, get_calls=500, get_usec=801_000, other_calls=4, cpu_s=2.6, cpu_source="main_thread")
    interval = interval_between(target, before, after)
    assert interval.get_calls == 400 and interval.get_calls_per_s == 200.0
    assert interval.get_usec_per_call == 2000.0
    assert interval.get_busy_pct == pytest.approx(40.0)  # 0.8 s of GETs in 2 s
    assert interval.main_cpu_pct == pytest.approx(80.0)
    assert interval.other_calls_per_s == 2.0
    assert interval_between(target, after, before).error == "counters reset"


def test_per_interval_get_counts_match_the_load_sent(two_shards):
    targets = expand_targets(None, None, [s.url for s in two_shards])
    clients = loaded_clients(two_shards)
    sampler = Sampler(targets)
    try:
        sampler.check_all()
        for load in [(137, 0), (0, 412), (50, 75), (0, 0)]:
            for client, count in zip(clients, load):
                send_gets(client, count)
            intervals = sampler.sample()
            assert [i.get_calls for i in intervals] == list(load)
            for interval in intervals:
                assert interval.error == ""
                assert interval.get_calls_per_s * interval.interval_s == pytest.approx(interval.get_calls)
                assert (interval.get_usec_per_call is None) == (interval.get_calls == 0)
                assert interval.main_cpu_pct >= 0
    finally:
        sampler.close()


def test_timed_sampling_accounts_for_every_get_sent(two_shards):
    targets = expand_targets(None, None, [s.url for s in two_shards])
    clients = loaded_clients(two_shards)
    sampler = Sampler(targets)
    stop = threading.Event()
    sampler.check_all()
    runner = threading.Thread(target=sampler.run, args=(0.25, None, stop))
    runner.start()
    try:
        sent = [0, 0]
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # a paced load over several intervals
            send_gets(clients[0], 10)
            send_gets(clients[1], 30)
            sent[0] += 10
            sent[1] += 30
            time.sleep(0.02)
        ticks = len(sampler.intervals)
        while len(sampler.intervals) < ticks + 2 * len(targets):  # two more samples after the load
            time.sleep(0.05)
    finally:
        stop.set()
        runner.join()
        sampler.close()
    for shard, expected in enumerate(sent):
        rows = [i for i in sampler.intervals if i.shard == shard]
        assert sum(i.get_calls for i in rows) == expected
        assert len([i for i in rows if i.get_calls]) >= 2  # the load spread over several intervals
        assert all(i.error == "" for i in rows)
    busy = sum(i.get_calls for i in sampler.intervals if i.shard == 1)
    assert busy == 3 * sum(i.get_calls for i in sampler.intervals if i.shard == 0)


def test_cli_runs_for_a_duration_and_writes_csv_and_png(two_shards, tmp_path, capsys):
    out = tmp_path / "out"
    clients = loaded_clients(two_shards)
    loader = threading.Thread(target=send_gets, args=(clients[0], 300))
    loader.start()
    code = valkey_cli.main(["--url", two_shards[0].url, "--url", two_shards[1].url, "--interval", "0.3",
                            "--duration", "1.2", "--out", str(out)])
    loader.join()
    assert code == 0
    with (out / "intervals.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {row["shard"] for row in rows} == {"0", "1"}
    assert 6 <= len(rows) <= 10  # about 4 intervals per shard
    summary = json.loads((out / "summary.json").read_text())
    assert [s["shard"] for s in summary["shards"]] == [0, 1]
    assert (out / "valkey_stats.png").read_bytes().startswith(PNG_MAGIC)
    assert "GET/s" in capsys.readouterr().out


def test_cli_stops_cleanly_on_sigint(valkey, tmp_path):
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "valkey-stats"), "--url", valkey.url, "--interval", "0.2", "--no-plots",
         "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        lines = 0
        while lines < 3:  # the start line and two intervals
            line = process.stderr.readline()
            assert line, "valkey-stats ended early"
            lines += 1
        process.send_signal(signal.SIGINT)
        stdout, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0
    assert "written:" in stdout
    assert json.loads((out / "summary.json").read_text())["stopped_by_signal"] is True
    assert len((out / "intervals.csv").read_text().splitlines()) >= 3


def test_a_shard_that_does_not_answer_is_named(valkey, tmp_path, capsys):
    dead = f"resp://127.0.0.1:{free_loopback_port()}"
    code = valkey_cli.main(["--url", valkey.url, "--url", dead, "--duration", "1", "--out", str(tmp_path)])
    assert code == 2
    assert f"cannot sample {dead}" in capsys.readouterr().err


def test_a_shard_lost_mid_run_is_reported_and_fails_the_run(two_shards, tmp_path, capsys):
    stopper = threading.Timer(0.5, two_shards[1].stop)
    stopper.start()
    code = valkey_cli.main(["--url", two_shards[0].url, "--url", two_shards[1].url, "--interval", "0.3",
                            "--duration", "1.5", "--timeout", "1", "--no-plots", "--out", str(tmp_path)])
    stopper.join()
    assert code == 1
    assert "sample(s) failed" in capsys.readouterr().err
    with (tmp_path / "intervals.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert any(row["shard"] == "1" and row["error"] for row in rows)
    assert all(row["error"] == "" for row in rows if row["shard"] == "0")
