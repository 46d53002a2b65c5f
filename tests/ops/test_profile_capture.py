"""The profiling wrapper: the nsys command, the start/stop window, engine processes, py-spy.

nsys is not on the CPU test hosts: the command is checked as built, not run.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opstools import profile_cli
from opstools.common import OpsError
from opstools.profiling import (
    ProcessInfo,
    build_nsys_command,
    dump_stacks,
    ensure_cuda_profiler,
    find_engine_processes,
    is_engine_process,
)

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
