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
    fail,
    positive_float,
    positive_int,
    prepare_out_dir,
    utc_iso,
)
from .profiling import (
    SERVE_ENVIRONMENT,
    DumpResult,
    build_nsys_command,
    default_pyspy,
    dump_stacks,
    find_engine_processes,
    post_profile_endpoint,
    shell_line,
)

TOOL = "profile-capture"

DESCRIPTION = """\
Capture an Nsight Systems timeline of a chosen window of a running vLLM engine, and
py-spy stack dumps of its processes (for stalls that leave the GPU timeline empty).

  1. command   print (or --exec) the serve command wrapped in
               nsys profile --trace=cuda,nvtx --capture-range=cudaProfilerApi ...
               with vLLM's --profiler-config '{"profiler": "cuda"}'
  2. window    POST /start_profile, wait (--seconds, or while --run CMD runs), POST /stop_profile;
               --pyspy also dumps the engine's stacks in the middle of the window
  3. pyspy     py-spy dump of every engine process, now

example:
  scripts/profile-capture command --out work/ops/prof -- vllm serve zai-org/GLM-5.3-FP8 --port 8000 ...
  scripts/profile-capture window --url http://127.0.0.1:8000 --seconds 10 --pyspy --out work/ops/prof
  scripts/profile-capture pyspy --out work/ops/stacks
"""

COMMAND_EPILOG = """\
Writes serve-under-nsys.sh into --out and prints it. The report goes to
<out>/<name>[.N].nsys-rep. --exec replaces this process with nsys (must be on PATH).

example:
  scripts/profile-capture command --out work/ops/prof -- vllm serve zai-org/GLM-5.3-FP8 \\
      --prefill-context-parallel-size 8 --port 8000
"""

WINDOW_EPILOG = """\
Writes window.json (start/stop times in UTC) and, with --pyspy, pyspy/<pid>-<title>.txt.
/stop_profile is sent even when --run fails or on Ctrl-C. Exit 2 when the engine has no
profiling endpoints (started without --profiler-config).

example:
  scripts/profile-capture window --url http://127.0.0.1:8000 \\
      --run 'scripts/replay run stream.jsonl --url http://127.0.0.1:8000 --out work/ops/r1'
"""

PYSPY_EPILOG = """\
Finds the engine by process title (VLLM::EngineCore, VLLM::Worker_*) and by
'vllm serve' in the command line, or takes the whole tree under --root-pid. Needs
ptrace rights on the engine (root, or CAP_SYS_PTRACE in a container).

example:
  scripts/profile-capture pyspy --root-pid 4242 --native --out work/ops/stacks
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
    win.add_argument("--endpoint-timeout", type=positive_float, default=300.0, metavar="S",
                     help="how long start/stop_profile may take (the engine flushes on stop)")
    win.add_argument("--out", type=Path, help="output folder (default: work/ops/profile-capture-<UTC time>/)")

    spy = sub.add_parser("pyspy", help="py-spy dump of every engine process", epilog=PYSPY_EPILOG,
                         formatter_class=HelpFormatter)
    spy.add_argument("--root-pid", type=positive_int, help="dump this process and all below it")
    spy.add_argument("--title-prefix", default="VLLM::", help="process title prefix (VLLM_PROCESS_NAME_PREFIX)")
    spy.add_argument("--native", action="store_true", help="include native (C/C++) frames")
    spy.add_argument("--locals", action="store_true", help="include local variables")
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


def command_window(args: argparse.Namespace) -> int:
    out = prepare_out_dir(args.out, TOOL)
    window: dict[str, object] = {"url": args.url}
    dumps: list[DumpResult] = []
    run_code: int | None = None
    post_profile_endpoint(args.url, "start_profile", args.endpoint_timeout)
    started = time.time()
    window["started_at_utc"] = utc_iso(started)
    print(f"{TOOL}: profiling started at {window['started_at_utc']}", file=sys.stderr, flush=True)
    interrupted = False
    try:
        if args.run:
            process = subprocess.Popen(args.run, shell=True)
            if args.pyspy:
                time.sleep(1.0)
                dumps = dump_stacks(find_engine_processes(args.root_pid), out / "pyspy", args.pyspy_path)
            run_code = process.wait()
            window["run"] = {"command": args.run, "exit": run_code}
        else:
            half = args.seconds / 2
            _sleep_with_progress(half, args.seconds)
            if args.pyspy:
                dumps = dump_stacks(find_engine_processes(args.root_pid), out / "pyspy", args.pyspy_path)
            _sleep_with_progress(args.seconds - half, args.seconds, already=half)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        with _sigint_ignored():  # let the stop call finish
            post_profile_endpoint(args.url, "stop_profile", args.endpoint_timeout)
        stopped = time.time()
        window["stopped_at_utc"] = utc_iso(stopped)
        window["seconds"] = round(stopped - started, 3)
        window["pyspy_dumps"] = [str(d.path) for d in dumps]
        (out / "window.json").write_text(json.dumps(window, indent=2) + "\n", encoding="utf-8")
    print(f"{TOOL}: profiling stopped after {window['seconds']} s; written: {out / 'window.json'}")
    failed_dumps = _print_dumps(dumps)
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


def _sleep_with_progress(seconds: float, total: float, already: float = 0.0) -> None:
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 5.0))
        elapsed = already + seconds - max(0.0, end - time.monotonic())
        if total > 10:
            print(f"{TOOL}: {elapsed:.0f}/{total:g} s of the window", file=sys.stderr, flush=True)


def command_pyspy(args: argparse.Namespace) -> int:
    processes = find_engine_processes(args.root_pid, args.title_prefix)
    if not processes:
        raise OpsError("no engine process found (no title starting with "
                       f"{args.title_prefix!r}, no 'vllm serve' command line); pass --root-pid")
    out = prepare_out_dir(args.out, TOOL)
    print(f"{TOOL}: py-spy dump of {len(processes)} process(es)", file=sys.stderr, flush=True)
    results = dump_stacks(processes, out / "pyspy", args.pyspy_path, args.native, args.locals)
    failed = _print_dumps(results)
    if failed:
        return fail(f"{failed} of {len(results)} dump(s) failed (see the files; ptrace rights?)", EXIT_FAILED, TOOL)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "command":
            return command_command(args)
        if args.command == "window":
            return command_window(args)
        return command_pyspy(args)
    except OpsError as exc:
        return fail(str(exc), EXIT_ERROR, TOOL)
