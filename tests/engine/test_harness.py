"""The engine harness's environment (no engine needed): every engine its own NIXL side-channel port."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import read_only_root
from tests.support.engine import NIXL_PORT_ENV, EngineSpec, absolute_pythonpath, engine_env

MODEL = Path("/models/tiny")
REPO = Path(__file__).resolve().parents[2]


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_every_engine_gets_a_free_nixl_side_channel_port(tmp_path, monkeypatch):
    # vLLM's default (5600) in the test's own environment must not leak through
    monkeypatch.setenv(NIXL_PORT_ENV, "5600")
    port = int(engine_env(EngineSpec(MODEL, {}), tmp_path)[NIXL_PORT_ENV])
    assert port != 5600 and 20000 <= port < 32000 and _free(port)
    # the listener binds the port plus the data-parallel index: a free block per engine
    dp = int(engine_env(EngineSpec(MODEL, {"data-parallel-size": 3}), tmp_path)[NIXL_PORT_ENV])
    assert all(_free(p) for p in range(dp, dp + 3))


def test_a_spec_that_names_its_nixl_port_keeps_it(tmp_path):
    spec = EngineSpec(MODEL, {}, env={NIXL_PORT_ENV: "23456"})
    assert engine_env(spec, tmp_path)[NIXL_PORT_ENV] == "23456"


def test_an_engine_runs_one_unbound_openmp_thread_unless_its_spec_binds(tmp_path):
    env = engine_env(EngineSpec(MODEL, {}, cpu_connector=False), tmp_path)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("nobind", "1")
    bound = EngineSpec(MODEL, {}, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, cpu_connector=False)
    assert engine_env(bound, tmp_path)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


def test_the_engine_imports_from_the_folders_the_test_does(tmp_path, monkeypatch):
    # the engine runs in its own work dir: a relative entry must not change meaning there
    monkeypatch.chdir(tmp_path)
    (tmp_path / "build").mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["build", "/opt/lmcache-variant", ""]))
    entries = engine_env(EngineSpec(MODEL, {}, cpu_connector=False),
                         tmp_path / "engine")["PYTHONPATH"].split(os.pathsep)
    assert entries == [str(tmp_path / "build"), "/opt/lmcache-variant", str(tmp_path)]
    assert absolute_pythonpath("") == ""


def test_a_read_only_root_engine_writes_only_its_folders(tmp_path):
    """The launcher of read_only_root engines: the named folder and /tmp (a tmpfs of its own)
    take writes; everything else (here the repository, never under /tmp) answers EROFS."""
    writable = tmp_path / "home"
    writable.mkdir()
    in_tmp = f"/tmp/read-only-root-{os.getpid()}"
    outside = REPO / f".read-only-root-{os.getpid()}"
    script = (f"touch {writable}/ok && touch {in_tmp} && grep -c ' /tmp .* - tmpfs ' /proc/self/mountinfo; "
              f"touch {outside}")
    try:
        done = subprocess.run(read_only_root.command(sys.executable, [str(writable)], ["sh", "-c", script]),
                              capture_output=True, text=True, timeout=30)
        assert (writable / "ok").exists() and not outside.exists(), done.stderr
    finally:
        outside.unlink(missing_ok=True)
    assert done.stdout.strip() == "1", done.stdout
    assert "Read-only file system" in done.stderr and done.returncode != 0, done.stderr
    assert not Path(in_tmp).exists()   # written to the engine's own tmpfs, gone with it


def test_a_folder_kept_under_tmp_stays_visible_and_read_only():
    """A checkout under /tmp (a clone there) would vanish under the engine's tmpfs: the
    launcher keeps it, read-only, and keeps the checkout it was started from on its own.
    Without --keep the same command finds nothing there."""
    import importlib.util
    import shutil
    import tempfile

    clone = Path(tempfile.mkdtemp(prefix="read-only-root-clone-", dir="/tmp"))
    try:
        (clone / "tests" / "support").mkdir(parents=True)
        launcher = clone / "tests" / "support" / "read_only_root.py"
        shutil.copy(read_only_root.__file__, launcher)
        (clone / "hello.sh").write_text("echo kept; touch \"$(dirname \"$0\")/written\"\n")
        spec = importlib.util.spec_from_file_location("clone_read_only_root", launcher)
        cloned = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cloned)
        argv = ["sh", str(clone / "hello.sh")]

        kept = subprocess.run(cloned.command(sys.executable, [], argv), capture_output=True, text=True, timeout=30)
        assert kept.stdout.strip() == "kept", kept.stderr
        assert "Read-only file system" in kept.stderr and not (clone / "written").exists(), kept.stderr

        bare = read_only_root.command(sys.executable, [], argv)
        assert str(clone) not in bare
        hidden = subprocess.run(bare, capture_output=True, text=True, timeout=30)
        assert hidden.returncode != 0 and "hello.sh" in hidden.stderr and not hidden.stdout, hidden
    finally:
        shutil.rmtree(clone)


def test_a_kept_or_writable_path_that_is_not_a_folder_is_refused_before_any_mount(tmp_path):
    for option in ("--keep", "--writable"):
        missing = tmp_path / f"absent{option}"
        done = subprocess.run([sys.executable, read_only_root.__file__, option, str(missing), "--", "true"],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 1 and f"read_only_root: {option} {missing}: not a folder" in done.stderr, done


def test_a_core_that_failed_to_start_fails_the_start_even_when_the_server_hangs(tmp_path, monkeypatch):
    """A stand-in server (a fake, to force the interleaving vLLM hits at random) logs vLLM's
    core-failure marker and never exits, as the server does when a worker loses its SIGTERM
    inside a __del__: the start fails soon after the marker, naming it, and the process is gone."""
    from tests.support import engine as engine_support
    monkeypatch.setattr(engine_support, "CORE_FAILED_EXIT_S", 1.0)
    server = tmp_path / "hung-server"
    server.write_text(f"#!/bin/sh\necho 'ERROR [core.py] {engine_support.CORE_FAILED}'\nexec sleep 600\n")
    server.chmod(0o755)
    spec = EngineSpec(MODEL, {}, cpu_connector=False, label="hung")
    with pytest.raises(engine_support.EngineError, match="engine core failed while starting") as raised:
        engine_support.start_engine(server, spec, tmp_path / "engine", startup_timeout_s=60)
    assert engine_support.CORE_FAILED in raised.value.log_text
    assert "not ready within" not in str(raised.value)
    assert not subprocess.run(["pgrep", "-f", str(server)], capture_output=True).stdout


def test_a_start_whose_lmcache_degraded_fails_at_once(tmp_path):
    """A stand-in server (a fake: it logs LMCache's degraded-mode line, as LMCacheManager
    does when its init fails outside shard mode, and then never answers) fails its start
    as soon as the line is logged, naming it: the harness does not wait for a server whose
    cache is already off."""
    from tests.support import engine as engine_support
    server = tmp_path / "degraded-server"
    server.write_text("#!/bin/sh\necho 'ERROR LMCache: Failed to initialize LMCacheManager components: "
                      "No supported cpu connector found. System will operate in degraded mode (recompute).'\n"
                      "exec sleep 600\n")
    server.chmod(0o755)
    spec = EngineSpec(MODEL, {}, lmcache_config={"chunk_size": 256}, cpu_connector=False, label="degraded")
    started = time.monotonic()
    with pytest.raises(engine_support.EngineError, match="degraded mode") as raised:
        engine_support.start_engine(server, spec, tmp_path / "engine", startup_timeout_s=60)
    assert time.monotonic() - started < 30
    assert "No supported cpu connector found" in str(raised.value)
    assert not subprocess.run(["pgrep", "-f", str(server)], capture_output=True).stdout


def test_a_start_that_times_out_says_how_long_its_log_has_been_silent(tmp_path):
    """A stand-in server (a fake that logs one line and never answers): the timeout names how
    long ago the log was last written, which tells a hung start from a slow one."""
    from tests.support import engine as engine_support
    server = tmp_path / "silent-server"
    server.write_text("#!/bin/sh\necho 'starting'\nexec sleep 600\n")
    server.chmod(0o755)
    spec = EngineSpec(MODEL, {}, cpu_connector=False, label="silent")
    with pytest.raises(engine_support.EngineError, match=r"not ready within 3 s \(its log last written \d+ s ago\)"):
        engine_support.start_engine(server, spec, tmp_path / "engine", startup_timeout_s=3)
    assert not subprocess.run(["pgrep", "-f", str(server)], capture_output=True).stdout
