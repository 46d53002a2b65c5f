"""``scripts/profile-capture``: Nsight Systems around a window, and py-spy dumps of the engine."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .common import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    HelpFormatter,
    OpsError,
    dispatch,
    fail,
    positive_float,
    positive_int,
    prepare_out_dir,
    utc_iso,
)
from .profiling import (
    SERVE_ENVIRONMENT,
    DumpResult,
    ProcessInfo,
    ThreadMotion,
    build_nsys_command,
    check_base_url,
    compare_dumps,
    default_pyspy,
    dump_rounds,
    find_engine_processes,
    post_profile_endpoint,
    shell_line,
)

TOOL = "profile-capture"
ENDPOINT_TIMEOUT_S = 10.0
WAIT_PROGRESS_S = 2.0  # a progress line this often while an endpoint has not answered
WINDOW_PROGRESS_S = 5.0  # and while the window runs
STILL_FRAMES_SHOWN = 4

DESCRIPTION = """\
Capture an Nsight Systems timeline of a chosen window of a running vLLM engine, and
py-spy stack dumps of its processes (for stalls that leave the GPU timeline empty).

  1. command   print (or --exec) the serve command wrapped in
               nsys profile --trace=cuda,nvtx --capture-range=cudaProfilerApi ...
               with vLLM's --profiler-config '{"profiler": "cuda"}'
  2. window    POST /start_profile, wait (--seconds, or while --run CMD runs), POST /stop_profile;
               --pyspy also dumps the engine's stacks in the middle of the window
  3. pyspy     py-spy dump of every engine process, now; --dumps N --interval S takes N dumps
               S seconds apart and names the threads whose stacks did not move

example:
  scripts/profile-capture command --out work/ops/prof -- vllm serve zai-org/GLM-5.3-FP8 --port 8000 ...
  scripts/profile-capture window --url http://127.0.0.1:8000 --seconds 10 --pyspy --out work/ops/prof
  scripts/profile-capture pyspy --out work/ops/stacks
  scripts/profile-capture pyspy --dumps 3 --interval 2 --out work/ops/stuck
"""

COMMAND_EPILOG = """\
Writes serve-under-nsys.sh into --out and prints it. The report goes to
<out>/<name>[.N].nsys-rep. --exec replaces this process with nsys (must be on PATH).

example:
  scripts/profile-capture command --out work/ops/prof -- vllm serve zai-org/GLM-5.3-FP8 \\
      --prefill-context-parallel-size 8 --port 8000
"""

WINDOW_EPILOG = """\
Writes window.json (start/stop times in UTC) and, with --pyspy, pyspy/<pid>-<title>.txt
(pyspy/<pid>-<title>.<k>.txt and stacks.json with --dumps N). /stop_profile is sent even
when --run fails or on Ctrl-C. Progress goes to stderr while it waits. Exit 2 when the
engine has no profiling endpoints (started without --profiler-config), does not answer
within --endpoint-timeout, or --url is not an HTTP server.

example:
  scripts/profile-capture window --url http://127.0.0.1:8000 \\
      --run 'scripts/replay run stream.jsonl --url http://127.0.0.1:8000 --out work/ops/r1'
"""

PYSPY_EPILOG = """\
Finds the engine by process title (VLLM::EngineCore, VLLM::Worker_*) and by
'vllm serve' in the command line, or takes the whole tree under --root-pid. Needs
ptrace rights on the engine (root, or CAP_SYS_PTRACE in a container).

With --dumps N (N >= 2) it takes N dumps --interval seconds apart, writes
pyspy/<pid>-<title>.<k>.txt and stacks.json, and prints per process the threads
whose Python stack (frames and lines) was the same in every dump, with their
innermost frames ("a <- b": a called from b): a thread stuck in fut.result()
stays, one passing through moves. A thread idle in its loop's wait stays too;
the frames printed tell which is which.

example:
  scripts/profile-capture pyspy --root-pid 4242 --native --out work/ops/stacks
  scripts/profile-capture pyspy --root-pid 4242 --dumps 3 --interval 2 --out work/ops/stuck
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=TOOL, description=DESCRIPTION, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{command,window,pyspy}")

    cmd = sub.add_parser("command", help="the nsys-wrapped serve command", epilog=COMMAND_EPILOG,
                         formatter_class=HelpFormatter)
    cmd.add_argument("serve", nargs=argparse.REMAINDER, help="-- then the vllm serve command line")
    cmd.add_argument("--name", default="glm-prefill", help="report file name (without .nsys-rep)")
    cmd.add_argument("--capture-range-end", default="repeat",
                     help="nsys --capture-range-end: repeat (one report per window) or stop (first window only)")
    cmd.add_argument("--nsys", default="nsys", help="the nsys executable")
    cmd.add_argument("--nsys-arg", action="append", default=[], metavar="ARG",
                     help="extra nsys argument, e.g. --nsys-arg=--gpu-metrics-devices=all (repeatable)")
    cmd.add_argument("--exec", action="store_true", help="run it now (replaces this process)")
    cmd.add_argument("--out", type=Path, help="output folder (default: work/ops/profile-capture-<UTC time>/)")

    win = sub.add_parser("window", help="start/stop profiling around a window", epilog=WINDOW_EPILOG,
                         formatter_class=HelpFormatter)
    win.add_argument("--url", required=True, help="base URL of the engine")
    group = win.add_mutually_exclusive_group()
    group.add_argument("--seconds", type=positive_float, default=10.0, help="window length")
    group.add_argument("--run", metavar="CMD", help="shell command to run inside the window (e.g. a replay)")
    win.add_argument("--pyspy", action="store_true",
                     help="py-spy dump of the engine in the middle of the window (1 s after --run starts)")
    win.add_argument("--root-pid", type=positive_int, help="for --pyspy: dump this process tree")
    win.add_argument("--py-spy", dest="pyspy_path", default=default_pyspy(),
                     help="the py-spy executable (default: the one beside this Python, else PATH's)")
    win.add_argument("--dumps", type=positive_int, default=1, metavar="N",
                     help="with --pyspy: N dumps --interval seconds apart, and the threads that did not move")
    win.add_argument("--interval", type=positive_float, default=1.0, metavar="S", help="seconds between --dumps")
    win.add_argument("--endpoint-timeout", type=positive_float, default=ENDPOINT_TIMEOUT_S, metavar="S",
                     help="seconds to wait for each of /start_profile and /stop_profile (the engine answers "
                          "/stop_profile once its workers have stopped profiling: raise it if that takes longer)")
    win.add_argument("--out", type=Path, help="output folder (default: work/ops/profile-capture-<UTC time>/)")

    spy = sub.add_parser("pyspy", help="py-spy dump of every engine process", epilog=PYSPY_EPILOG,
                         formatter_class=HelpFormatter)
    spy.add_argument("--root-pid", type=positive_int, help="dump this process and all below it")
    spy.add_argument("--title-prefix", default="VLLM::", help="process title prefix (VLLM_PROCESS_NAME_PREFIX)")
    spy.add_argument("--native", action="store_true", help="include native (C/C++) frames")
    spy.add_argument("--locals", action="store_true", help="include local variables")
    spy.add_argument("--dumps", type=positive_int, default=1, metavar="N",
                     help="N dumps of every process, --interval seconds apart; N >= 2 names the threads whose "
                          "stacks did not move")
    spy.add_argument("--interval", type=positive_float, default=1.0, metavar="S", help="seconds between --dumps")
    spy.add_argument("--py-spy", dest="pyspy_path", default=default_pyspy(),
                     help="the py-spy executable (default: the one beside this Python, else PATH's)")
    spy.add_argument("--out", type=Path, help="output folder (default: work/ops/profile-capture-<UTC time>/)")
    return parser


def command_command(args: argparse.Namespace) -> int:
    serve = list(args.serve)
    if serve and serve[0] == "--":
        serve = serve[1:]
    out = prepare_out_dir(args.out, TOOL)
    nsys_command = build_nsys_command(serve, out.resolve() / args.name, args.nsys, args.capture_range_end,
                                      args.nsys_arg)
    line = shell_line(nsys_command, SERVE_ENVIRONMENT)
    script = out / "serve-under-nsys.sh"
    script.write_text("#!/bin/sh\n# written by scripts/profile-capture command\nexec env " + line + "\n",
                      encoding="utf-8")
    script.chmod(0o755)
    print(line)
    print(f"written: {script}; then: scripts/profile-capture window --url http://<host>:<port> --seconds N",
          file=sys.stderr)
    if args.exec:
        if shutil.which(args.nsys) is None:
            raise OpsError(f"{args.nsys}: not found on PATH; install Nsight Systems (nsight-systems-cli) "
                           f"or run {script} where it is")
        os.execvpe(nsys_command[0], nsys_command, {**os.environ, **SERVE_ENVIRONMENT})
    return EXIT_OK


def _print_dumps(results: list[DumpResult]) -> int:
    for result in results:
        state = "ok" if result.ok else f"FAILED (exit {result.returncode})"
        print(f"  {result.process.pid:>7}  {result.process.title[:60]:<60}  {state}  {result.path}")
    return sum(not r.ok for r in results)


def _progress(message: str) -> None:
    print(f"{TOOL}: {message}", file=sys.stderr, flush=True)


def _take_dumps(processes: list[ProcessInfo], folder: Path, args: argparse.Namespace, native: bool = False,
                show_locals: bool = False) -> list[list[DumpResult]]:
    def on_round(k: int) -> None:
        of = f" {k} of {args.dumps}" if args.dumps > 1 else ""
        _progress(f"py-spy dump{of}: {len(processes)} process(es)")

    return dump_rounds(processes, folder, args.pyspy_path, args.dumps, args.interval, native, show_locals, on_round)


def _motion_json(motion: ThreadMotion) -> dict[str, object]:
    return {"thread": motion.thread_id, "name": motion.name, "still": motion.still, "seen_in": motion.seen_in,
            "states": list(motion.states), "frames": list(motion.frames)}


def stacks_report(rounds: list[list[DumpResult]]) -> list[dict[str, object]]:
    """Per process, its dumps and how each of its threads moved across them (stacks.json)."""
    report = []
    for results in zip(*rounds):
        process = results[0].process
        entry: dict[str, object] = {"pid": process.pid, "title": process.title, "dumps": [str(r.path) for r in results]}
        failed = [r for r in results if not r.ok]
        if failed:
            entry["error"] = f"{len(failed)} of {len(results)} dump(s) failed; see {failed[0].path}"
        else:
            motions = compare_dumps([r.path.read_text(encoding="utf-8") for r in results])
            entry["threads"] = [_motion_json(m) for m in motions]
        report.append(entry)
    return report


def _print_still_threads(report: list[dict[str, object]], dumps: int, interval_s: float) -> None:
    span = f"{dumps} dumps over {(dumps - 1) * interval_s:g} s"
    for entry in report:
        head = f"pid {entry['pid']} {str(entry['title'])[:60]}: {span}"
        if "error" in entry:
            print(f"{head}: {entry['error']}")
            continue
        threads = entry["threads"]
        still = [t for t in threads if t["still"]]
        print(f"{head}; {len(still)} of {len(threads)} thread(s) did not move")
        for thread in threads:
            name = f' "{thread["name"]}"' if thread["name"] else ""
            label = f"Thread {thread['thread']}{name}"
            if thread["still"]:
                frames = " <- ".join(thread["frames"][:STILL_FRAMES_SHOWN])  # innermost first
                print(f"  still  {label} ({thread['states'][-1]}): {frames}")
            elif thread["seen_in"] < dumps:
                print(f"  came or went  {label}: in {thread['seen_in']} of {dumps} dumps")
            else:
                print(f"  moved  {label} ({', '.join(dict.fromkeys(thread['states']))})")


def _write_stacks(out: Path, rounds: list[list[DumpResult]], args: argparse.Namespace) -> list[dict[str, object]]:
    report = stacks_report(rounds)
    (out / "stacks.json").write_text(json.dumps({"dumps": args.dumps, "interval_s": args.interval,
                                                 "processes": report}, indent=2) + "\n", encoding="utf-8")
    return report


def _check_dump_args(args: argparse.Namespace) -> None:
    if args.dumps > 1 and not getattr(args, "pyspy", True):
        raise OpsError("--dumps needs --pyspy")


def _wait_for_endpoint(url: str, name: str, timeout_s: float) -> None:
    _progress(f"POST {url.rstrip('/')}/{name} (waiting up to {timeout_s:g} s)")
    post_profile_endpoint(url, name, timeout_s,
                          on_wait=lambda waited: _progress(f"waiting for /{name}: {waited:.0f} of {timeout_s:g} s"),
                          progress_every_s=WAIT_PROGRESS_S)


def _start_window(args: argparse.Namespace) -> Path:
    """Check the arguments, create --out, POST /start_profile; a refused start leaves no new folder behind."""
    check_base_url(args.url)
    _check_dump_args(args)
    existed = args.out is not None and args.out.exists()
    out = prepare_out_dir(args.out, TOOL)
    try:
        _wait_for_endpoint(args.url, "start_profile", args.endpoint_timeout)
    except OpsError:
        if not existed:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if still empty
        raise
    return out


def command_window(args: argparse.Namespace) -> int:
    out = _start_window(args)
    window: dict[str, object] = {"url": args.url}
    rounds: list[list[DumpResult]] = []
    run_code: int | None = None
    started = time.time()
    window_end = time.monotonic() + (args.seconds or 0.0)
    window["started_at_utc"] = utc_iso(started)
    _progress(f"profiling started at {window['started_at_utc']}")
    interrupted = False
    try:
        if args.run:
            process = subprocess.Popen(args.run, shell=True)
            if args.pyspy:
                time.sleep(1.0)
                rounds = _take_dumps(find_engine_processes(args.root_pid), out / "pyspy", args)
            run_code = process.wait()
            window["run"] = {"command": args.run, "exit": run_code}
        else:
            _sleep_with_progress(window_end - args.seconds / 2, window_end, args.seconds)
            if args.pyspy:
                rounds = _take_dumps(find_engine_processes(args.root_pid), out / "pyspy", args)
            _sleep_with_progress(window_end, window_end, args.seconds)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stop_error = ""
        with _sigint_ignored():  # let the stop call finish
            try:
                _wait_for_endpoint(args.url, "stop_profile", args.endpoint_timeout)
            except OpsError as exc:
                stop_error = window["stop_error"] = str(exc)
        stopped = time.time()
        window["stopped_at_utc"] = utc_iso(stopped)
        window["seconds"] = round(stopped - started, 3)
        window["pyspy_dumps"] = [str(d.path) for results in rounds for d in results]
        report = _write_stacks(out, rounds, args) if args.dumps > 1 and rounds else []
        if report:
            window["still_threads"] = {str(e["pid"]): [t["thread"] for t in e.get("threads", []) if t["still"]]
                                       for e in report}
        (out / "window.json").write_text(json.dumps(window, indent=2) + "\n", encoding="utf-8")
    closed = "the stop was not answered" if stop_error else "profiling stopped"
    print(f"{TOOL}: {closed} after {window['seconds']} s; written: {out / 'window.json'}")
    failed_dumps = sum(_print_dumps(results) for results in rounds)
    if report:
        _print_still_threads(report, args.dumps, args.interval)
    if stop_error:
        return fail(f"{stop_error}; the engine may still be profiling", EXIT_ERROR, TOOL)
    if interrupted:
        return fail("interrupted; the window was closed with /stop_profile", EXIT_INTERRUPTED, TOOL)
    if run_code:
        return fail(f"--run command exited {run_code}", EXIT_FAILED, TOOL)
    if failed_dumps:
        return fail(f"{failed_dumps} py-spy dump(s) failed", EXIT_FAILED, TOOL)
    return EXIT_OK


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _sleep_with_progress(until: float, window_end: float, total: float) -> None:
    """Sleep until ``until`` (time.monotonic()), a progress line after every full WINDOW_PROGRESS_S."""
    while (left := until - time.monotonic()) > 0:
        time.sleep(min(left, WINDOW_PROGRESS_S))
        if left > WINDOW_PROGRESS_S:
            _progress(f"{total - max(0.0, window_end - time.monotonic()):.0f}/{total:g} s of the window")


def command_pyspy(args: argparse.Namespace) -> int:
    processes = find_engine_processes(args.root_pid, args.title_prefix)
    if not processes:
        raise OpsError("no engine process found (no title starting with "
                       f"{args.title_prefix!r}, no 'vllm serve' command line); pass --root-pid")
    out = prepare_out_dir(args.out, TOOL)
    rounds = _take_dumps(processes, out / "pyspy", args, args.native, args.locals)
    failed = sum(_print_dumps(results) for results in rounds)
    if args.dumps > 1:
        _print_still_threads(_write_stacks(out, rounds, args), args.dumps, args.interval)
    if failed:
        total = sum(len(results) for results in rounds)
        return fail(f"{failed} of {total} dump(s) failed (see the files; ptrace rights?)", EXIT_FAILED, TOOL)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return dispatch(TOOL, args, {"command": command_command, "window": command_window, "pyspy": command_pyspy})
