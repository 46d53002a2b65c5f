"""The profiling wrapper: the nsys command, the start/stop window, engine processes, py-spy.

nsys is not on the CPU test hosts: the command is checked as built, not run.
"""
from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from opstools import profile_cli
from opstools.common import OpsError
from opstools.profiling import (
    DumpResult,
    ProcessInfo,
    build_nsys_command,
    compare_dumps,
    dump_stacks,
    ensure_cuda_profiler,
    find_engine_processes,
    is_engine_process,
    parse_dump,
)

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SERVE = ["vllm", "serve", "zai-org/GLM-5.3-FP8", "--prefill-context-parallel-size", "8", "--port", "8000"]


def test_nsys_command_wraps_the_serve_command_with_the_cuda_profiler():
    command = build_nsys_command(SERVE, Path("/out/glm"))
    assert command == [
        "nsys", "profile", "--trace=cuda,nvtx", "--capture-range=cudaProfilerApi", "--capture-range-end=repeat",
        "--trace-fork-before-exec=true", "--cuda-graph-trace=node", "--force-overwrite=true", "--output=/out/glm",
        *SERVE, "--profiler-config", '{"profiler": "cuda"}',
    ]
    stop = build_nsys_command(SERVE, Path("o"), nsys="/opt/nsys/bin/nsys", capture_range_end="stop",
                              extra_nsys_args=["--gpu-metrics-devices=all"])
    assert stop[0] == "/opt/nsys/bin/nsys" and "--capture-range-end=stop" in stop
    assert stop.index("--gpu-metrics-devices=all") < stop.index("vllm")


@pytest.mark.parametrize(
    "given",
    [
        ["--profiler-config", '{"profiler":"cuda"}'],
        ['--profiler-config={"profiler": "cuda", "max_iterations": 50}'],
        ["--profiler-config.profiler", "cuda"],
        ["--profiler-config.profiler=cuda"],
    ],
)
def test_an_existing_cuda_profiler_config_is_kept(given):
    assert ensure_cuda_profiler(SERVE + given) == SERVE + given


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/t"}'], "needs the 'cuda' profiler"),
        (["--profiler-config.profiler", "proton"], "needs the 'cuda' profiler"),
        (["--profiler-config", "{cuda"], "is not JSON"),
        (["--profiler-config"], "has no value"),
    ],
)
def test_a_wrong_profiler_config_is_an_error(given, message):
    with pytest.raises(OpsError, match=message):
        ensure_cuda_profiler(SERVE + given)


def test_bad_capture_settings_are_errors():
    with pytest.raises(OpsError, match="would shut the engine down"):
        build_nsys_command(SERVE, Path("o"), capture_range_end="stop-shutdown")
    with pytest.raises(OpsError, match="use one of"):
        build_nsys_command(SERVE, Path("o"), capture_range_end="forever")
    with pytest.raises(OpsError, match="no serve command"):
        build_nsys_command([], Path("o"))


def test_command_writes_the_script_and_exec_needs_nsys(tmp_path, capsys, monkeypatch):
    code = profile_cli.main(["command", "--out", str(tmp_path), "--", *SERVE])
    assert code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("VLLM_WORKER_MULTIPROC_METHOD=spawn nsys profile --trace=cuda,nvtx")
    assert line.endswith("""--profiler-config '{"profiler": "cuda"}'""")
    script = tmp_path / "serve-under-nsys.sh"
    assert script.read_text().endswith(f"exec env {line}\n") and script.stat().st_mode & 0o111
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert profile_cli.main(["command", "--exec", "--out", str(tmp_path), "--", *SERVE]) == 2
    assert "nsys: not found on PATH" in capsys.readouterr().err


def test_window_starts_and_stops_profiling_around_it(engine, tmp_path):
    code = profile_cli.main(["window", "--url", engine.url, "--seconds", "1", "--out", str(tmp_path)])
    assert code == 0
    (start, started), (stop, stopped) = engine.profile_calls
    assert (start, stop) == ("/start_profile", "/stop_profile")
    assert stopped - started >= 0.95
    window = json.loads((tmp_path / "window.json").read_text())
    assert window["seconds"] >= 0.95 and window["started_at_utc"] < window["stopped_at_utc"]


def test_window_stops_profiling_when_the_run_command_fails(engine, tmp_path, capsys):
    code = profile_cli.main(["window", "--url", engine.url, "--run", "exit 3", "--out", str(tmp_path)])
    assert code == 1
    assert [path for path, _ in engine.profile_calls] == ["/start_profile", "/stop_profile"]
    assert "--run command exited 3" in capsys.readouterr().err
    assert json.loads((tmp_path / "window.json").read_text())["run"]["exit"] == 3


def test_window_without_profiling_endpoints_says_how_to_enable_them(engine, tmp_path, capsys):
    engine.profiling_enabled = False
    code = profile_cli.main(["window", "--url", engine.url, "--seconds", "1", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "/start_profile: HTTP 404" in err and "--profiler-config" in err


def fake_proc(root: Path, pid: int, ppid: int, comm: str, cmdline: str) -> None:
    entry = root / str(pid)
    entry.mkdir()
    (entry / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")
    (entry / "comm").write_text(comm + "\n")
    (entry / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")


def test_engine_processes_are_found_by_title_or_by_tree(tmp_path):
    fake_proc(tmp_path, 90, 1, "nsys", "nsys profile --trace=cuda,nvtx vllm serve glm")
    fake_proc(tmp_path, 100, 90, "vllm", "/usr/bin/python3 /usr/local/bin/vllm serve glm --port 8000")
    fake_proc(tmp_path, 101, 100, "VLLM::EngineCor", "VLLM::EngineCore")
    fake_proc(tmp_path, 102, 101, "VLLM::Worker_PC", "VLLM::Worker_PCP0_EP0")
    fake_proc(tmp_path, 103, 101, "VLLM::Worker_PC", "VLLM::Worker_PCP1_EP1")
    fake_proc(tmp_path, 104, 101, "pt_main_thread", "/usr/bin/python3 -c from multiprocessing.resource_tracker")
    fake_proc(tmp_path, 200, 1, "valkey-server", "valkey-server *:6379")
    fake_proc(tmp_path, 300, 1, "weird) name", "")  # a comm with a parenthesis
    found = find_engine_processes(proc_root=tmp_path)
    assert [p.pid for p in found] == [100, 101, 102, 103]
    under_nsys = find_engine_processes(root_pid=90, proc_root=tmp_path)
    assert [p.pid for p in under_nsys] == [100, 101, 102, 103, 104]  # nsys itself is no Python process
    tree = find_engine_processes(root_pid=101, proc_root=tmp_path)
    assert [p.pid for p in tree] == [101, 102, 103, 104]
    with pytest.raises(OpsError, match="no such process"):
        find_engine_processes(root_pid=999, proc_root=tmp_path)
    assert is_engine_process(ProcessInfo(1, 0, "python", "python -m vllm.entrypoints.openai.api_server"))
    assert is_engine_process(ProcessInfo(1, 0, "vllm", "/usr/local/bin/vllm serve glm"))
    assert not is_engine_process(ProcessInfo(1, 0, "python", "python train.py"))
    assert not is_engine_process(ProcessInfo(1, 0, "nsys", "nsys profile vllm serve glm"))


def _py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def test_py_spy_dumps_every_process_of_a_real_tree(tmp_path):
    pyspy = _py_spy()
    if pyspy is None:
        pytest.skip("py-spy is not installed")
    child = "import time; time.sleep(60)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 20
        tree = []
        while time.monotonic() < deadline and len(tree) < 2:
            time.sleep(0.2)
            tree = find_engine_processes(root_pid=process.pid)
        assert len(tree) == 2
        results = dump_stacks(tree, tmp_path / "pyspy", pyspy=pyspy, timeout_s=60)
    finally:
        for info in reversed(find_engine_processes(root_pid=process.pid)):
            subprocess.run(["kill", str(info.pid)], check=False)
        process.wait(10)
    if not all(r.ok for r in results):
        text = results[0].path.read_text()
        if "Permission" in text or "ptrace" in text.lower():
            pytest.skip("no ptrace rights here")
        pytest.fail(text)
    for result in results:
        text = result.path.read_text()
        assert f"pid {result.process.pid}" in text
        assert "time.sleep" in text or "<module>" in text


def test_py_spy_defaults_to_the_one_beside_the_interpreter(tmp_path, monkeypatch):
    from opstools.profiling import default_pyspy

    (tmp_path / "bin").mkdir()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    assert default_pyspy() == "py-spy"   # none there: PATH's
    (tmp_path / "bin" / "py-spy").write_text("")
    assert default_pyspy() == str(tmp_path / "bin" / "py-spy")


# --- several dumps: the threads that did not move ---------------------------------------------

# A process with a thread stuck in fut.result() and one whose stack grows every 50 ms (never the same twice).
STUCK_AND_MOVING = textwrap.dedent("""\
    import sys, threading, time
    from concurrent.futures import Future

    def wait_for_a_result_that_never_comes():
        Future().result()

    def walk_down(depth):
        time.sleep(0.05)
        walk_down(depth + 1)

    threading.Thread(target=wait_for_a_result_that_never_comes, name="stuck-waiter", daemon=True).start()
    threading.Thread(target=walk_down, args=(0,), name="walker", daemon=True).start()
    print("ready", flush=True)
    time.sleep(60)
""")


@contextmanager
def stuck_and_moving_process():
    process = subprocess.Popen([sys.executable, "-c", STUCK_AND_MOVING], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "ready\n"
        yield process
    finally:
        process.kill()
        process.wait(10)


def _live_pyspy_or_skip(pid: int, tmp_path: Path) -> str:
    """py-spy's path, after one dump of ``pid`` showed it may read other processes here."""
    pyspy = _py_spy()
    if pyspy is None:
        pytest.skip("py-spy is not installed")
    (probe,) = dump_stacks([ProcessInfo(pid, 0, "python", "python")], tmp_path / "probe", pyspy=pyspy)
    if not probe.ok:
        text = probe.path.read_text()
        if "Permission" in text or "ptrace" in text.lower():
            pytest.skip("no ptrace rights here; test_still_threads_from_recorded_dumps covers the comparison")
        pytest.fail(text)
    return pyspy


def test_pyspy_dumps_name_the_thread_stuck_in_a_future(tmp_path, capsys):
    with stuck_and_moving_process() as process:
        pyspy = _live_pyspy_or_skip(process.pid, tmp_path)
        code = profile_cli.main(["pyspy", "--root-pid", str(process.pid), "--dumps", "3", "--interval", "0.3",
                                 "--py-spy", pyspy, "--out", str(tmp_path / "out")])
    assert code == 0
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "py-spy dump" in line] == [
        f"profile-capture: py-spy dump {k} of 3: 1 process(es)" for k in (1, 2, 3)]
    dumps = sorted((tmp_path / "out" / "pyspy").glob("*.txt"))
    assert [d.name.rsplit(".", 2)[1] for d in dumps] == ["1", "2", "3"]
    (entry,) = json.loads((tmp_path / "out" / "stacks.json").read_text())["processes"]
    threads = {t["name"]: t for t in entry["threads"]}
    assert threads["stuck-waiter"]["still"] and threads["stuck-waiter"]["seen_in"] == 3
    assert any(f.startswith("Future.result (") for f in threads["stuck-waiter"]["frames"])
    assert not threads["walker"]["still"]
    out = captured.out
    assert f"pid {process.pid} " in out and "3 dumps over 0.6 s" in out
    assert 'still  Thread ' in out and '"stuck-waiter" (idle): Condition.wait (threading.py:' in out
    assert "<- Future.result (concurrent/futures/_base.py:" in out
    assert [line.split('"')[1] for line in out.splitlines() if line.startswith("  moved  ")] == ["walker"]


def _dump(*threads: str) -> str:
    """A py-spy 0.4.3 dump as profile-capture writes it: its header, py-spy's, then the threads."""
    return ("# py-spy dump --pid 4242 --locals\n# pid 4242 ppid 4200: VLLM::EngineCore\n# exit 0\n"
            "Process 4242: VLLM::EngineCore\nPython v3.11.7 (python3.11)\n\n"
            + "".join(textwrap.dedent(block) for block in threads))


def _a_stuck_lookup(locals_address: str) -> str:
    return f"""\
    Thread 4300 (idle): "lookup"
        Condition.wait (threading.py:327)
            Arguments:
                self: <Condition at {locals_address}>
                timeout: None
        Future.result (concurrent/futures/_base.py:451)
        LookupClient.wait_for_lookup (engine/lookup.py:88)
        Thread.run (threading.py:982)
    """


# Recorded dumps of one process, in the text py-spy 0.4.3 prints (tests that need no ptrace rights):
# the main thread steps through its loop; "lookup" waits on the same future all along (its --locals
# lines differ, they are not frames); "store" is in the same function on another line each time;
# "io" sits in the same Python frames under a native frame whose raw address moves (--native);
# "transfer-1" exists only in the last dump.
RECORDED = [
    _dump("""\
    Thread 4242 (active+gil): "MainThread"
        Engine.step (engine/core.py:402)
        Engine.run_busy_loop (engine/core.py:874)
    """, _a_stuck_lookup("0x7f295e9b9ad0"), """\
    Thread 4301 (active): "store"
        StoreWorker.put (engine/store.py:140)
        StoreWorker.run (engine/store.py:61)
    Thread 4302 (idle): "io"
        0x7f603a8a3f16 (libc.so.6)
        epoll_wait (libc.so.6)
        EventLoop.poll (engine/io.py:30)
        EventLoop.run (engine/io.py:12)
    """),
    _dump("""\
    Thread 4242 (active): "MainThread"
        Scheduler.schedule (engine/scheduler.py:210)
        Engine.step (engine/core.py:398)
        Engine.run_busy_loop (engine/core.py:874)
    """, _a_stuck_lookup("0x7f295e9b9ad1"), """\
    Thread 4301 (active+gil): "store"
        StoreWorker.put (engine/store.py:152)
        StoreWorker.run (engine/store.py:61)
    Thread 4302 (idle): "io"
        0x7f603a8a3f9a (libc.so.6)
        epoll_wait (libc.so.6)
        EventLoop.poll (engine/io.py:30)
        EventLoop.run (engine/io.py:12)
    """),
    _dump("""\
    Thread 4242 (active+gil): "MainThread"
        Engine.step (engine/core.py:415)
        Engine.run_busy_loop (engine/core.py:874)
    """, _a_stuck_lookup("0x7f295e9b9ad2"), """\
    Thread 4301 (idle): "store"
        StoreWorker.put (engine/store.py:140)
        StoreWorker.run (engine/store.py:61)
    Thread 4302 (idle): "io"
        0x7f603a8a3f16 (libc.so.6)
        epoll_wait (libc.so.6)
        EventLoop.poll (engine/io.py:30)
        EventLoop.run (engine/io.py:12)
    Thread 4310 (active): "transfer-1"
        Transfer.copy (engine/transfer.py:77)
    """),
]


def test_a_dump_text_is_read_thread_by_thread():
    threads = parse_dump(RECORDED[0])
    assert [(t.thread_id, t.name, t.state) for t in threads] == [
        ("4242", "MainThread", "active+gil"), ("4300", "lookup", "idle"), ("4301", "store", "active"),
        ("4302", "io", "idle")]
    assert threads[1].frames == ("Condition.wait (threading.py:327)", "Future.result (concurrent/futures/_base.py:451)",
                                 "LookupClient.wait_for_lookup (engine/lookup.py:88)", "Thread.run (threading.py:982)")
    assert threads[3].position == ("EventLoop.poll (engine/io.py:30)", "EventLoop.run (engine/io.py:12)")
    assert parse_dump("# exit 1\nError: Permission denied (os error 13)\n") == []


def test_still_threads_from_recorded_dumps(tmp_path, capsys):
    motions = {m.name: m for m in compare_dumps(RECORDED)}
    assert {name for name, m in motions.items() if m.still} == {"lookup", "io"}
    assert not motions["MainThread"].still and not motions["store"].still
    assert (motions["transfer-1"].seen_in, motions["transfer-1"].still) == (1, False)
    assert motions["store"].states == ("active", "active+gil", "idle")
    assert [m.still for m in compare_dumps(RECORDED)][:2] == [True, True]  # still threads first
    assert not any(m.still for m in compare_dumps(RECORDED[:1]))  # one dump shows no motion
    # The report the CLI prints and writes, from the recorded files.
    engine = ProcessInfo(4242, 4200, "VLLM::EngineCor", "VLLM::EngineCore")
    rounds = []
    for k, text in enumerate(RECORDED, start=1):
        path = tmp_path / f"4242-VLLM__EngineCore.{k}.txt"
        path.write_text(text)
        rounds.append([DumpResult(engine, path, 0)])
    report = profile_cli.stacks_report(rounds)
    profile_cli._print_still_threads(report, 3, 2.0)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "pid 4242 VLLM::EngineCore: 3 dumps over 4 s; 2 of 5 thread(s) did not move"
    assert out[1] == ('  still  Thread 4300 "lookup" (idle): Condition.wait (threading.py:327) <- Future.result '
                      '(concurrent/futures/_base.py:451) <- LookupClient.wait_for_lookup (engine/lookup.py:88) <- '
                      'Thread.run (threading.py:982)')
    assert out[3] == '  moved  Thread 4242 "MainThread" (active+gil, active)'
    assert out[5] == '  came or went  Thread 4310 "transfer-1": in 1 of 3 dumps'
    failed = [[DumpResult(engine, rounds[0][0].path, 0)], [DumpResult(engine, rounds[1][0].path, 1)]]
    assert "1 of 2 dump(s) failed" in profile_cli.stacks_report(failed)[0]["error"]


def test_window_takes_several_dumps_inside_it(engine, tmp_path, capsys):
    with stuck_and_moving_process() as process:
        pyspy = _live_pyspy_or_skip(process.pid, tmp_path)
        code = profile_cli.main(["window", "--url", engine.url, "--seconds", "0.5", "--pyspy", "--root-pid",
                                 str(process.pid), "--dumps", "2", "--interval", "0.2", "--py-spy", pyspy,
                                 "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    (start, _), (stop, _) = engine.profile_calls
    assert (start, stop) == ("/start_profile", "/stop_profile")
    window = json.loads((tmp_path / "out" / "window.json").read_text())
    assert len(window["pyspy_dumps"]) == 2
    (still,) = window["still_threads"].values()
    stacks = json.loads((tmp_path / "out" / "stacks.json").read_text())
    names = {t["thread"]: t["name"] for t in stacks["processes"][0]["threads"]}
    assert "stuck-waiter" in {names[t] for t in still} and "walker" not in {names[t] for t in still}


# --- endpoints that do not answer, or not in HTTP ----------------------------------------------


@contextmanager
def tcp_server(reply: bytes | None):
    """A TCP server on a free loopback port: reads a request, then sends ``reply`` and closes, or, with
    None, never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(connection)
            connection.recv(4096)
            if reply is not None:
                connection.sendall(reply)
                connection.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        server.join()
        for connection in accepted:
            connection.close()
        listener.close()


def test_the_endpoint_timeout_is_seconds_and_a_silent_server_shows_progress(tmp_path, capsys, monkeypatch):
    window = profile_cli.build_parser().parse_args(["window", "--url", "http://h:1"])
    assert window.endpoint_timeout == 10.0
    monkeypatch.setattr(profile_cli, "WAIT_PROGRESS_S", 0.2)
    out = tmp_path / "out"
    with tcp_server(None) as url:
        started = time.monotonic()
        code = profile_cli.main(["window", "--url", url, "--seconds", "1", "--endpoint-timeout", "1",
                                 "--out", str(out)])
        elapsed = time.monotonic() - started
    assert code == 2 and elapsed < 3
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"profile-capture: POST {url}/start_profile (waiting up to 1 s)"
    assert len([line for line in err if line.startswith("profile-capture: waiting for /start_profile: ")]) >= 3
    assert err[-1] == f"profile-capture: error: {url}/start_profile: no answer within 1 s"
    assert not out.exists()  # nothing written


def test_a_non_http_port_is_a_one_line_error(valkey, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "profile-capture"), "window", "--url",
                           f"http://{valkey.host}:{valkey.port}", "--seconds", "1", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert last == (f"profile-capture: error: http://{valkey.host}:{valkey.port}/start_profile: the server closed "
                    "the connection without an HTTP answer; is this the engine's HTTP port?")
    with tcp_server(b"SSH-2.0-OpenSSH_9.6\r\n") as url:
        with pytest.raises(OpsError, match=r"/start_profile: not an HTTP answer \(BadStatusLine: 'SSH-2.0"):
            profile_cli.post_profile_endpoint(url, "start_profile", 5.0)


def test_an_unanswered_stop_still_writes_the_window(tmp_path, capsys):
    """The stop call is held until the test ends, never answered in time; the start call is answered at
    once, and its 5 s endpoint timeout is a bound on a hang (0.5 s failed once on a loaded host)."""
    release = threading.Event()

    class StartOnly(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the handler's name)
            if self.path == "/stop_profile":
                release.wait(60)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StartOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code = profile_cli.main(["window", "--url", url, "--seconds", "0.2", "--endpoint-timeout", "5",
                                 "--out", str(tmp_path)])
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"profile-capture: error: {url}/stop_profile: no answer within 5 s; the engine may still be profiling")
    window = json.loads((tmp_path / "window.json").read_text())
    assert window["stop_error"] == f"{url}/stop_profile: no answer within 5 s"


@pytest.mark.parametrize(("args", "message"), [
    (["--url", "127.0.0.1:8000"], "--url '127.0.0.1:8000': expected the engine's HTTP base URL"),
    (["--url", "http://127.0.0.1:notaport"], "bad port"),
    (["--url", "http://127.0.0.1:1", "--dumps", "3"], "--dumps needs --pyspy"),
])
def test_bad_window_arguments_are_one_line_errors(args, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert profile_cli.main(["window", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("profile-capture: error: ") and message in err and err.count("\n") == 1
    assert not out.exists()
