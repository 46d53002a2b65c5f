"""The Valkey stats sampler against real Valkey 8.1 servers under the loads the tests send."""
from __future__ import annotations

import csv
import json
import random
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
    COMMANDS,
    INFO_SECTIONS,
    PERCENTILES,
    Sampler,
    ServerSample,
    expand_targets,
    interval_between,
    parse_shard_url,
    sample_from_info,
)

from tests.support.ports import free_loopback_port
from tests.support.valkey import start_valkey

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAXMEMORY = 4 * 2**20  # a few dozen values: evictions from the second batch of SETs on
VALUE = b"c" * (64 * 1024)


@pytest.fixture
def two_shards(valkey, tmp_path):
    second = start_valkey(tmp_path)
    try:
        yield [valkey, second]
    finally:
        second.stop()


@pytest.fixture
def small_valkey(tmp_path):
    """A real Valkey with the deployment's eviction policy and a small maxmemory."""
    server = start_valkey(tmp_path, ["--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "allkeys-lru"])
    try:
        yield server
    finally:
        server.stop()


class MixedLoad:
    """SET new chunk keys, GET / EXISTS / MGET random earlier ones, as LMCache's stores, loads and
    lookups do; counts what Valkey must report: calls per command, keyspace hits and misses
    (EXISTS and MGET count per key), and the keys written (evicted = written - DBSIZE)."""

    def __init__(self, client, seed: int = 7) -> None:
        self.client = client
        self.rng = random.Random(seed)
        self.written = 0
        self.sent = dict.fromkeys(COMMANDS, 0)
        self.hits = self.misses = 0

    def _keys(self, n: int) -> list[str]:
        return [f"chunk:{self.rng.randrange(max(1, self.written))}" for _ in range(n)]

    def _found(self, found: int, of: int) -> None:
        self.hits += found
        self.misses += of - found

    def send(self, sets: int, gets: int, exists: int, mgets: int) -> None:
        for _ in range(sets):
            self.client.set(f"chunk:{self.written}", VALUE)
            self.written += 1
        for (key,) in (self._keys(1) for _ in range(gets)):
            self._found(self.client.get(key) is not None, 1)
        for keys in (self._keys(2) for _ in range(exists)):
            self._found(self.client.exists(*keys), 2)
        for keys in (self._keys(3) for _ in range(mgets)):
            self._found(sum(v is not None for v in self.client.mget(keys)), 3)
        for name, n in zip(("set", "get", "exists", "mget"), (sets, gets, exists, mgets)):
            self.sent[name] += n

    def evicted(self) -> int:
        return self.written - self.client.dbsize()  # no TTLs, no deletes: every missing key was evicted


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
            "cmdstat_exists": {"calls": 7, "usec": 4}, "cmdstat_client|setinfo": {"calls": 2, "usec": 1},
            "cmdstat_info": {"calls": 99, "usec": 1}, "used_cpu_user": 9.0, "used_cpu_sys": 9.0,
            "used_cpu_user_main_thread": 1.5, "used_cpu_sys_main_thread": 0.5,
            "evicted_keys": 4, "keyspace_hits": 5, "keyspace_misses": 6, "used_memory": 1000, "maxmemory": 2000}
    sample = sample_from_info(info, 1.0, 0.0)
    assert sample.calls == {"get": 10, "set": 3, "exists": 7, "mget": 0}  # MGET never sent: no cmdstat line
    assert sample.usec == {"get": 50, "set": 9, "exists": 4, "mget": 0}
    assert (sample.other_calls, sample.total_usec) == (2, 50 + 9 + 4 + 1 + 1)  # INFO is not "other", but busy
    assert (sample.cpu_s, sample.cpu_source) == (2.0, "main_thread")
    assert (sample.evicted_keys, sample.keyspace_hits, sample.keyspace_misses) == (4, 5, 6)
    assert (sample.used_memory, sample.maxmemory) == (1000, 2000)
    old_server = {k: v for k, v in info.items() if "main_thread" not in k}
    assert sample_from_info(old_server, 1.0, 0.0).cpu_source == "process"


def _sample(at, get=(0, 0), set_=(0, 0), exists=(0, 0), mget=(0, 0), total_usec=0, other=0, cpu=0.0, **kw):
    calls = {"get": get[0], "set": set_[0], "exists": exists[0], "mget": mget[0]}
    usec = {"get": get[1], "set": set_[1], "exists": exists[1], "mget": mget[1]}
    return ServerSample(at, at, calls, usec, total_usec, other, cpu, "main_thread", **kw)


def test_interval_figures_and_counter_reset():
    target = parse_shard_url("resp://h:1", 0)
    before = _sample(0.0, get=(100, 1_000), set_=(10, 500), total_usec=2_000, cpu=1.0,
                     evicted_keys=3, keyspace_misses=1, used_memory=10)
    after = _sample(2.0, get=(500, 801_000), set_=(30, 200_500), exists=(50, 1_000), total_usec=1_004_000,
                    other=4, cpu=2.6, evicted_keys=13, keyspace_misses=8, used_memory=99, maxmemory=100)
    interval = interval_between(target, before, after)
    assert interval.get_calls == 400 and interval.get_calls_per_s == 200.0
    assert interval.get_usec_per_call == 2000.0
    assert interval.get_busy_pct == pytest.approx(40.0)  # 0.8 s of GETs in 2 s
    assert interval.command("set").calls == 20 and interval.command("set").usec_per_call == 10_000.0
    assert interval.command("set").busy_pct == pytest.approx(10.0)
    assert interval.command("exists").calls_per_s == 25.0
    assert interval.command("mget").calls == 0 and interval.command("mget").usec_per_call is None
    assert interval.total_busy_pct == pytest.approx(50.1)  # 1.002 s of any command in 2 s
    assert interval.main_cpu_pct == pytest.approx(80.0)
    assert interval.other_calls_per_s == 2.0
    assert (interval.evicted_keys, interval.keyspace_misses) == (10, 7)
    assert (interval.used_memory_bytes, interval.maxmemory_bytes) == (99, 100)  # gauges: the later sample
    assert interval_between(target, after, before).error == "counters reset"
    evictions_reset = _sample(4.0, get=(600, 900_000), set_=(30, 200_500), exists=(50, 1_000),
                              total_usec=1_200_000, other=4, cpu=3.0, evicted_keys=0)
    assert interval_between(target, after, evictions_reset).error == "counters reset"


def test_mixed_load_with_evictions_per_command_and_interval(small_valkey):
    client = small_valkey.client()
    client.ping()  # connected before the baseline: the handshake is not part of the load
    load = MixedLoad(client)
    sampler = Sampler(expand_targets(None, None, [small_valkey.url]))
    evicted = []
    try:
        sampler.check_all()
        for sets, gets, exists, mgets in [(20, 20, 15, 5), (120, 60, 40, 10), (0, 25, 25, 8), (0, 0, 0, 0)]:
            before = dict(load.sent), load.hits, load.misses
            load.send(sets, gets, exists, mgets)
            (interval,) = sampler.sample()
            memory = client.info("memory")["used_memory"]
            assert interval.error == ""
            for name in COMMANDS:
                sent = load.sent[name] - before[0][name]
                stats = interval.command(name)
                assert stats.calls == sent, name
                assert (stats.usec_per_call is None) == (sent == 0), name
                assert stats.busy_pct >= 0
            assert interval.keyspace_hits == load.hits - before[1]
            assert interval.keyspace_misses == load.misses - before[2]
            assert interval.total_busy_pct >= sum(interval.command(n).busy_pct for n in COMMANDS)
            assert interval.maxmemory_bytes == MAXMEMORY
            assert interval.used_memory_bytes == pytest.approx(memory, rel=0.05)  # INFO memory right after
            evicted.append(interval.evicted_keys)
    finally:
        sampler.close()
    assert evicted[0] == 0 and evicted[1] > 0  # 20 values fit in maxmemory, the next 120 do not
    assert sum(evicted) == load.evicted()
    assert load.misses > 0 and load.hits > 0


def test_cli_reports_the_mixed_load_per_command_in_csv_summary_and_png(small_valkey, tmp_path):
    out = tmp_path / "out"
    client = small_valkey.client()
    client.ping()
    process = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "valkey-stats"), "--url", small_valkey.url, "--interval", "0.4",
         "--duration", "3", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert "sampling 1 shard(s)" in process.stderr.readline()  # printed after the baseline sample
        load = MixedLoad(client, seed=3)
        load.send(150, 80, 40, 10)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    (shard,) = json.loads((out / "summary.json").read_text())["shards"]
    for name in COMMANDS:
        assert shard["commands"][name]["calls"] == load.sent[name], name
    assert shard["evicted_keys"] == load.evicted() > 0
    assert (shard["keyspace_hits"], shard["keyspace_misses"]) == (load.hits, load.misses)
    assert shard["maxmemory_bytes"] == MAXMEMORY and 0 < shard["max_used_memory_bytes"]
    with (out / "intervals.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert sum(int(r["set_calls"]) for r in rows) == load.sent["set"]
    assert sum(int(r["evicted_keys"]) for r in rows) == load.evicted()
    assert all(float(r["total_busy_pct"]) >= float(r["get_busy_pct"]) for r in rows)
    assert (out / "valkey_stats.png").read_bytes().startswith(PNG_MAGIC)
    assert "EXISTS/s" in stdout and "evicted" in stdout


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


# --- network bytes, latency percentiles, errors and clients --------------------------------------

# The only bytes a shard moves besides the load's are the sampler's own INFO round trips: one request
# per interval (computable: INFO_REQUEST_BYTES) and one reply per interval (the previous sample's, text
# of a few KB that depends on the counters in it). Input bytes are therefore checked exactly, output
# bytes between the load's replies and those plus INFO_REPLY_MAX_BYTES per interval.
INFO_REPLY_MAX_BYTES = 16 * 1024


def resp_bulk_bytes(data: bytes) -> int:
    return len(b"$%d\r\n" % len(data)) + len(data) + 2


def resp_request_bytes(*args: str | bytes | int) -> int:
    """Bytes of a command as a client sends it: a RESP array of bulk strings."""
    parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
    return len(b"*%d\r\n" % len(parts)) + sum(resp_bulk_bytes(p) for p in parts)


INFO_REQUEST_BYTES = resp_request_bytes("INFO", *INFO_SECTIONS)
RECENT_KEYS = 40  # of 64 KiB: 2.6 MB, within MAXMEMORY
OK_REPLY_BYTES = len(b"+OK\r\n")
NULL_REPLY_BYTES = len(b"$-1\r\n")


def error_reply_bytes(error: Exception) -> int:
    """valkey-py drops the generic "ERR " of an error reply and keeps any other code (WRONGTYPE ...)."""
    text = str(error)
    code = text.split(" ", 1)[0]
    return len(b"-\r\n") + len(text if code.isupper() else "ERR " + text)


class CountedLoad:
    """SET new 64 KiB chunk keys, GET and EXISTS random earlier ones (LMCache's stores, loads, lookups),
    through one valkey-py client speaking RESP2, counting the bytes it sends and receives."""

    def __init__(self, client, seed: int = 11) -> None:
        self.client = client
        self.rng = random.Random(seed)
        self.written = 0
        self.sent_bytes = 0
        self.received_bytes = 0
        self.calls = dict.fromkeys(COMMANDS, 0)

    def _key(self) -> str:
        """Mostly among the recent keys (most of which maxmemory still holds), now and then an older one."""
        recent = self.rng.random() < 0.8
        oldest = max(0, self.written - RECENT_KEYS) if recent else 0
        return f"chunk:{self.rng.randrange(oldest, max(1, self.written))}"

    def _count(self, command: str, request: int, reply: int) -> None:
        self.calls[command] += 1
        self.sent_bytes += request
        self.received_bytes += reply

    def send(self, sets: int, gets: int, exists: int) -> None:
        for _ in range(sets):
            key = f"chunk:{self.written}"
            self.client.set(key, VALUE)
            self.written += 1
            self._count("set", resp_request_bytes("SET", key, VALUE), OK_REPLY_BYTES)
        for _ in range(gets):
            key = self._key()
            value = self.client.get(key)
            self._count("get", resp_request_bytes("GET", key),
                        NULL_REPLY_BYTES if value is None else resp_bulk_bytes(value))
        for _ in range(exists):
            keys = [self._key(), self._key()]
            found = self.client.exists(*keys)
            self._count("exists", resp_request_bytes("EXISTS", *keys), len(b":%d\r\n" % found))

    def send_errors(self) -> None:
        """Two GETs and a SET refused for their arity (rejected calls), an INCRBY of text and an LPUSH onto
        a string (failed calls): error replies ERR x 4, WRONGTYPE x 1."""
        self.client.set("text", b"abc")
        self.sent_bytes += resp_request_bytes("SET", "text", b"abc")
        self.received_bytes += OK_REPLY_BYTES
        for args in [("GET",), ("GET",), ("SET", "k"), ("INCRBY", "text", 1), ("LPUSH", "text", "x")]:
            with pytest.raises(Exception) as refused:
                self.client.execute_command(*args)
            self.sent_bytes += resp_request_bytes(*args)
            self.received_bytes += error_reply_bytes(refused.value)

    def evicted(self) -> int:
        return self.written - self.client.dbsize() + 1  # no TTLs, no deletes; "text" is not a chunk


def test_bytes_latency_errors_clients_and_evictions_per_interval(small_valkey):
    client = small_valkey.client()
    client.ping()  # connected (and its handshake sent) before the baseline
    load = CountedLoad(client)
    sampler = Sampler(expand_targets(None, None, [small_valkey.url]))
    intervals = []
    replies = []  # the bytes of the load's replies, per interval
    try:
        sampler.check_all()
        for phase in [lambda: load.send(20, 20, 15), lambda: load.send(120, 60, 40), load.send_errors,
                      lambda: None]:
            sent, received = load.sent_bytes, load.received_bytes
            phase()
            (interval,) = sampler.sample()
            assert interval.error == ""
            assert interval.net_input_bytes == load.sent_bytes - sent + INFO_REQUEST_BYTES
            moved_out = load.received_bytes - received
            assert moved_out <= interval.net_output_bytes <= moved_out + INFO_REPLY_MAX_BYTES
            assert interval.net_out_bytes_per_s * interval.interval_s == pytest.approx(interval.net_output_bytes)
            assert interval.net_in_bytes_per_s * interval.interval_s == pytest.approx(interval.net_input_bytes)
            assert interval.connected_clients == 2  # the load's client and the sampler's
            intervals.append(interval)
            replies.append(moved_out)
    finally:
        sampler.close()
    loaded = intervals[1]  # 120 SETs, 60 GETs (most of them hits) of 64 KiB: 7.9 MB in, about 3 MB out
    assert loaded.net_input_bytes > 120 * len(VALUE)
    assert replies[1] > 20 * len(VALUE)
    assert loaded.net_output_bytes / replies[1] == pytest.approx(1.0, abs=0.01)  # the INFO reply: a few KB
    for name in ("get", "set", "exists"):  # lifetime percentiles, present once the command ran
        latency = loaded.command(name).latency_usec
        assert set(latency) == set(PERCENTILES), name
        assert 0 < latency["p50"] <= latency["p99"] <= latency["p99.9"], name
    assert loaded.command("mget").latency_usec == {}  # never called
    errors = intervals[2]
    assert (errors.command("get").rejected_calls, errors.command("set").rejected_calls) == (2, 1)
    assert (errors.rejected_calls, errors.failed_calls) == (3, 2)
    assert errors.errors == {"ERR": 4, "WRONGTYPE": 1} and errors.error_replies == 5
    assert all(i.error_replies == 0 and i.rejected_calls == 0 for i in intervals if i is not errors)
    assert intervals[0].evicted_keys == 0 and loaded.evicted_keys > 0
    assert sum(i.evicted_keys for i in intervals) == load.evicted()


def test_cli_reports_bytes_latency_errors_and_b_per_shard(small_valkey, tmp_path):
    out = tmp_path / "out"
    client = small_valkey.client()
    client.ping()
    process = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "valkey-stats"), "--url", small_valkey.url, "--interval", "0.4",
         "--duration", "1.6", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert "sampling 1 shard(s)" in process.stderr.readline()  # printed after the baseline sample
        load = CountedLoad(client, seed=5)
        load.send(100, 80, 40)
        load.send_errors()
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    (shard,) = json.loads((out / "summary.json").read_text())["shards"]
    intervals = shard["intervals"]
    assert shard["net_input_bytes"] == load.sent_bytes + intervals * INFO_REQUEST_BYTES
    assert load.received_bytes <= shard["net_output_bytes"] <= load.received_bytes + intervals * INFO_REPLY_MAX_BYTES
    assert shard["max_net_out_bytes_per_s"] >= shard["mean_net_out_bytes_per_s"] > 0
    assert shard["errors"] == {"ERR": 4, "WRONGTYPE": 1} and shard["rejected_calls"] == 3
    assert shard["commands"]["get"]["rejected_calls"] == 2
    assert shard["evicted_keys"] == load.evicted() > 0
    assert shard["last_connected_clients"] == 2
    for name in ("get", "set", "exists"):
        assert set(shard["commands"][name]["latency_usec"]) == set(PERCENTILES), name
    with (out / "intervals.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert sum(int(r["net_output_bytes"]) for r in rows) == shard["net_output_bytes"]
    assert all(float(r["net_out_bytes_per_s"]) * float(r["interval_s"]) == pytest.approx(int(r["net_output_bytes"]),
                                                                                         rel=1e-3, abs=1)
               for r in rows)
    assert any(r["errors"] == "ERR=4;WRONGTYPE=1" for r in rows)
    assert all(r["get_p99_usec"] for r in rows if int(r["get_calls"]))
    assert (out / "valkey_stats.png").read_bytes().startswith(PNG_MAGIC)
    assert "out MB/s" in stdout and "p50/p99/p99.9" in stdout
    assert f"shard 0: mean {shard['mean_net_out_bytes_per_s'] / 1e9:.3f} GB/s" in stdout
    assert "kv-sizing's --instance-gbps" in stdout
