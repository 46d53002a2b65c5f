"""Nsight Systems capture of a window, driven through vLLM's profiling endpoints.

What vLLM 0.31.0 provides (read in its source):

- ``--profiler-config '{"profiler": "cuda"}'`` (``vllm/config/profiler.py``,
  ``ProfilerConfig.profiler`` is one of ``torch``, ``cuda``, ``proton``);
  also accepted as ``--profiler-config.profiler cuda``.
- With a profiler configured, the API server mounts ``POST /start_profile`` and
  ``POST /stop_profile`` (``vllm/entrypoints/serve/profile/api_router.py``);
  without one they are absent (HTTP 404).
- The ``cuda`` profiler calls ``torch.cuda.profiler.start()/stop()``
  (``CudaProfilerWrapper`` in ``vllm/profiler/wrapper.py``), i.e.
  ``cudaProfilerStart/Stop`` in every worker, which is what
  ``nsys profile --capture-range=cudaProfilerApi`` waits for.
- vLLM's profiling guide recommends ``--trace-fork-before-exec=true
  --cuda-graph-trace=node`` for nsys and ``VLLM_WORKER_MULTIPROC_METHOD=spawn``.
- Process titles: ``VLLM::EngineCore`` (``_DP<n>`` with data parallelism) and
  ``VLLM::Worker[_DP<n>][_PP<n>][_PCP<n>][_TP<n>][_DCP<n>][_EP<n>]``
  (``set_process_title``, prefix from ``VLLM_PROCESS_NAME_PREFIX``), which
  is how :func:`find_engine_processes` recognises the engine.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .common import OpsError

CUDA_PROFILER_CONFIG = '{"profiler": "cuda"}'
NSYS_TRACE = "cuda,nvtx"
CAPTURE_RANGE_ENDS = ("repeat", "stop", "stop-shutdown")
SERVE_ENVIRONMENT = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
DEFAULT_TITLE_PREFIX = "VLLM::"


def _profiler_from_config_value(value: str, flag: str) -> str | None:
    try:
        config = json.loads(value)
    except json.JSONDecodeError:
        raise OpsError(f"{flag} {value!r} in the serve command is not JSON") from None
    if not isinstance(config, dict):
        raise OpsError(f"{flag} {value!r} in the serve command is not a JSON object")
    return config.get("profiler")


def ensure_cuda_profiler(serve_command: list[str]) -> list[str]:
    """The serve command with ``--profiler-config '{"profiler": "cuda"}'`` (added when absent).

    A profiler config naming another profiler is an error: nsys would wait
    for a capture range that never starts.
    """
    command = list(serve_command)
    found: str | None = None
    index = 0
    while index < len(command):
        arg = command[index]
        value: str | None = None
        flag = arg.split("=", 1)[0]
        if flag in ("--profiler-config", "--profiler-config.profiler"):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif index + 1 < len(command):
                value = command[index + 1]
                index += 1
            else:
                raise OpsError(f"{flag} at the end of the serve command has no value")
            profiler = _profiler_from_config_value(value, flag) if flag == "--profiler-config" else value
            if profiler != "cuda":
                raise OpsError(f"the serve command sets {flag} to {value!r}; nsys capture needs the 'cuda' "
                               f"profiler: --profiler-config '{CUDA_PROFILER_CONFIG}'")
            found = profiler
        index += 1
    if found is None:
        command += ["--profiler-config", CUDA_PROFILER_CONFIG]
    return command


def build_nsys_command(
    serve_command: list[str],
    output: Path,
    nsys: str = "nsys",
    capture_range_end: str = "repeat",
    extra_nsys_args: list[str] | None = None,
) -> list[str]:
    """``nsys profile ... <serve command>`` capturing only between start/stop_profile."""
    if not serve_command:
        raise OpsError("no serve command given; put it after '--', e.g. -- vllm serve zai-org/GLM-5.3-FP8 ...")
    if capture_range_end.split(":", 1)[0] not in CAPTURE_RANGE_ENDS:
        raise OpsError(f"--capture-range-end {capture_range_end!r}: use one of {', '.join(CAPTURE_RANGE_ENDS)}"
                       " (repeat:N allowed)")
    if capture_range_end == "stop-shutdown":
        raise OpsError("--capture-range-end stop-shutdown would shut the engine down after the first window; "
                       "use repeat or stop")
    return [
        nsys, "profile",
        f"--trace={NSYS_TRACE}",
        "--capture-range=cudaProfilerApi",
        f"--capture-range-end={capture_range_end}",
        "--trace-fork-before-exec=true",
        "--cuda-graph-trace=node",
        "--force-overwrite=true",
        f"--output={output}",
        *(extra_nsys_args or []),
        *ensure_cuda_profiler(serve_command),
    ]


def shell_line(command: list[str], env: dict[str, str] | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(command)


# -- the profiling window ------------------------------------------------------

def check_base_url(url: str) -> str:
    """The engine's base URL, http(s)://HOST[:PORT][/prefix]; raises :class:`OpsError` naming it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OpsError(f"--url {url!r}: expected the engine's HTTP base URL, e.g. http://127.0.0.1:8000")
    try:
        parts.port
    except ValueError:
        raise OpsError(f"--url {url!r}: bad port") from None
    return url


def _post(url: str, timeout_s: float) -> None:
    """One POST; every way it can fail becomes an :class:`OpsError` naming the URL."""
    request = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise OpsError(f"{url}: HTTP 404, the engine serves no profiling endpoints; start it with "
                           f"--profiler-config '{CUDA_PROFILER_CONFIG}'") from None
        raise OpsError(f"{url}: HTTP {exc.code}: {exc.read()[:200]!r}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise OpsError(f"{url}: no answer within {timeout_s:g} s") from None
        raise OpsError(f"{url}: cannot connect: {exc.reason}") from None
    except TimeoutError:
        raise OpsError(f"{url}: no answer within {timeout_s:g} s") from None
    except http.client.RemoteDisconnected:
        raise OpsError(f"{url}: the server closed the connection without an HTTP answer; is this the "
                       "engine's HTTP port?") from None
    except http.client.HTTPException as exc:
        raise OpsError(f"{url}: not an HTTP answer ({type(exc).__name__}: {str(exc)[:80]!r}); is this the "
                       "engine's HTTP port?") from None
    except OSError as exc:
        raise OpsError(f"{url}: the connection failed without an HTTP answer ({exc.strerror or exc}); is this "
                       "the engine's HTTP port?") from None


def post_profile_endpoint(base_url: str, name: str, timeout_s: float,
                          on_wait: Callable[[float], None] | None = None, progress_every_s: float = 2.0) -> None:
    """``POST /start_profile`` or ``/stop_profile`` within ``timeout_s`` in all; raises :class:`OpsError`
    naming the URL. While it waits, ``on_wait(seconds waited)`` every ``progress_every_s``."""
    url = base_url.rstrip("/") + f"/{name}"
    failure: list[OpsError] = []

    def call() -> None:
        try:
            _post(url, timeout_s)
        except OpsError as exc:
            failure.append(exc)

    # The socket timeout bounds each read, not the answer: a server that trickles bytes could hold the
    # call far longer, so the wait is bounded here and the call left to its daemon thread.
    caller = threading.Thread(target=call, name=f"POST /{name}", daemon=True)
    started = time.monotonic()
    caller.start()
    while True:
        waited = time.monotonic() - started
        caller.join(max(0.0, min(progress_every_s, timeout_s - waited)))
        if not caller.is_alive():
            break
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise OpsError(f"{url}: no answer within {timeout_s:g} s")
        if on_wait is not None:
            on_wait(waited)
    if failure:
        raise failure[0]


# -- engine processes and py-spy -----------------------------------------------

@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    name: str  # /proc/<pid>/comm
    cmdline: str
    exe: str = ""  # target of /proc/<pid>/exe, when readable

    @property
    def title(self) -> str:
        return self.cmdline or self.name


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:
        return ""


def list_processes(proc_root: Path = Path("/proc")) -> dict[int, ProcessInfo]:
    processes: dict[int, ProcessInfo] = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _read(entry / "stat")
        if not stat:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses
        after_comm = stat.rsplit(")", 1)[-1].split()
        try:
            ppid = int(after_comm[1])
        except (IndexError, ValueError):
            continue
        cmdline = _read(entry / "cmdline").replace("\x00", " ").strip()
        try:
            exe = os.readlink(entry / "exe")
        except OSError:
            exe = ""
        processes[int(entry.name)] = ProcessInfo(int(entry.name), ppid, _read(entry / "comm").strip(), cmdline, exe)
    return processes


def descendants(root_pid: int, processes: dict[int, ProcessInfo]) -> list[ProcessInfo]:
    """``root_pid`` and every process below it, parents first."""
    children: dict[int, list[int]] = {}
    for info in processes.values():
        children.setdefault(info.ppid, []).append(info.pid)
    if root_pid not in processes:
        raise OpsError(f"--root-pid {root_pid}: no such process")
    order: list[ProcessInfo] = []
    pending = [root_pid]
    while pending:
        pid = pending.pop(0)
        order.append(processes[pid])
        pending.extend(sorted(children.get(pid, [])))
    return order


def is_engine_process(info: ProcessInfo, title_prefix: str = DEFAULT_TITLE_PREFIX) -> bool:
    """A vLLM process: titled ``VLLM::...``, or ``vllm serve`` / a vLLM entrypoint run by Python.

    A wrapper whose arguments name vLLM (``nsys profile ... vllm serve``) is not one.
    """
    text = info.cmdline
    if text.startswith(title_prefix) or info.name.startswith(title_prefix[:15]):
        return True
    words = text.split()
    if not words:
        return False
    program = os.path.basename(words[0])
    if program == "vllm":
        return words[1:2] == ["serve"]
    if "python" in program:
        script = [os.path.basename(w) for w in words[1:3]]
        return "vllm" in script or "vllm.entrypoints" in text
    return False


def is_python_process(info: ProcessInfo, title_prefix: str = DEFAULT_TITLE_PREFIX) -> bool:
    """What py-spy can read: a Python executable, or a vLLM process (its title hides the interpreter)."""
    first_word = info.cmdline.split(" ", 1)[0]
    return (
        "python" in os.path.basename(info.exe)
        or "python" in os.path.basename(first_word)
        or is_engine_process(info, title_prefix)
    )


def find_engine_processes(
    root_pid: int | None = None,
    title_prefix: str = DEFAULT_TITLE_PREFIX,
    proc_root: Path = Path("/proc"),
) -> list[ProcessInfo]:
    """Engine processes: the Python processes of the tree under ``root_pid`` (an ``nsys`` or
    shell wrapper above them is left out), else every vLLM-looking process."""
    processes = list_processes(proc_root)
    own = os.getpid()
    if root_pid is not None:
        return [p for p in descendants(root_pid, processes) if p.pid != own and is_python_process(p, title_prefix)]
    return sorted(
        (p for p in processes.values() if p.pid != own and is_engine_process(p, title_prefix)),
        key=lambda p: p.pid,
    )


def default_pyspy() -> str:
    """py-spy beside this interpreter (pip puts it in the venv's bin, which is on PATH only
    in an activated venv), else ``py-spy`` from PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else "py-spy"


def pyspy_command(pid: int, pyspy: str = "py-spy", native: bool = False, show_locals: bool = False) -> list[str]:
    command = [pyspy, "dump", "--pid", str(pid)]
    if native:
        command.append("--native")
    if show_locals:
        command.append("--locals")
    return command


@dataclass(frozen=True)
class DumpResult:
    process: ProcessInfo
    path: Path
    returncode: int

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _safe_name(text: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
    return keep.strip("_")[:60] or "process"


def dump_stacks(
    processes: list[ProcessInfo],
    folder: Path,
    pyspy: str = "py-spy",
    native: bool = False,
    show_locals: bool = False,
    timeout_s: float = 60.0,
    suffix: str = "",
) -> list[DumpResult]:
    """One ``py-spy dump`` per process, each written to ``folder/<pid>-<title><suffix>.txt``."""
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for process in processes:
        command = pyspy_command(process.pid, pyspy, native, show_locals)
        path = folder / f"{process.pid}-{_safe_name(process.title.split(' ')[0])}{suffix}.txt"
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            text, code = done.stdout + done.stderr, done.returncode
        except FileNotFoundError:
            raise OpsError(
                f"{pyspy}: not found; install it (python3 -m pip install py-spy) or pass --py-spy PATH"
            ) from None
        except subprocess.TimeoutExpired:
            text, code = f"py-spy dump timed out after {timeout_s:g} s\n", 124
        header = f"# {shlex.join(command)}\n# pid {process.pid} ppid {process.ppid}: {process.title}\n# exit {code}\n"
        path.write_text(header + text, encoding="utf-8")
        results.append(DumpResult(process, path, code))
    return results


def dump_rounds(
    processes: list[ProcessInfo],
    folder: Path,
    pyspy: str = "py-spy",
    dumps: int = 1,
    interval_s: float = 1.0,
    native: bool = False,
    show_locals: bool = False,
    on_round: Callable[[int], None] | None = None,
) -> list[list[DumpResult]]:
    """``dumps`` rounds of :func:`dump_stacks`, a round starting every ``interval_s`` (or when the previous
    one ends, if later). One round writes ``<pid>-<title>.txt``; several write ``<pid>-<title>.<k>.txt``.
    ``on_round(k)`` is called before round k (1-based)."""
    rounds: list[list[DumpResult]] = []
    begin = time.monotonic()
    for k in range(1, dumps + 1):
        time.sleep(max(0.0, begin + (k - 1) * interval_s - time.monotonic()))
        if on_round is not None:
            on_round(k)
        suffix = f".{k}" if dumps > 1 else ""
        rounds.append(dump_stacks(processes, folder, pyspy, native, show_locals, suffix=suffix))
    return rounds


# -- threads that did not move across dumps ------------------------------------

_THREAD = re.compile(r'^Thread (?P<id>\S+) \((?P<state>[^)]*)\)(?:: "(?P<name>.*)")?\s*$')
_FRAME = re.compile(r"^ {4}(?P<frame>[^ ].*?)\s*$")  # deeper lines are --locals' arguments and locals
_PYTHON_FRAME = re.compile(r"\((?:[^()]*\.py|<[^>]*>):\d+\)$")
_ADDRESS_FRAME = re.compile(r"^0x[0-9a-fA-F]+ ")


@dataclass(frozen=True)
class ThreadStack:
    """One thread of one ``py-spy dump``: innermost frame first, as py-spy prints them."""

    thread_id: str
    name: str
    state: str  # idle, active, active+gil
    frames: tuple[str, ...]

    @property
    def position(self) -> tuple[str, ...]:
        """What must stay the same for the thread not to have moved: its Python frames (with their lines);
        a thread without any (native only) by its native frames, without raw addresses."""
        python = tuple(f for f in self.frames if _PYTHON_FRAME.search(f))
        return python or tuple(f for f in self.frames if not _ADDRESS_FRAME.match(f))


def parse_dump(text: str) -> list[ThreadStack]:
    """The threads of a ``py-spy dump`` text (our header lines and py-spy's own are skipped)."""
    threads: list[ThreadStack] = []
    current: dict | None = None
    for line in text.splitlines():
        thread = _THREAD.match(line)
        if thread:
            if current is not None:
                threads.append(ThreadStack(**current))
            current = {"thread_id": thread["id"], "name": thread["name"] or "", "state": thread["state"],
                       "frames": ()}
            continue
        frame = _FRAME.match(line)
        if frame and current is not None:
            current["frames"] += (frame["frame"],)
    if current is not None:
        threads.append(ThreadStack(**current))
    return threads


@dataclass(frozen=True)
class ThreadMotion:
    """One thread across a process's dumps."""

    thread_id: str
    name: str
    states: tuple[str, ...]  # in each dump it appears in
    seen_in: int  # dumps it appears in
    dumps: int
    still: bool  # in every dump, with the same Python stack each time
    frames: tuple[str, ...]  # its stack in the last dump it appears in

    def label(self) -> str:
        name = f' "{self.name}"' if self.name else ""
        return f"Thread {self.thread_id}{name}"


def compare_dumps(texts: list[str]) -> list[ThreadMotion]:
    """Which threads did not move across ``texts`` (one process's dumps, in order): still ones first."""
    by_thread: dict[str, list[ThreadStack]] = {}
    for text in texts:
        for thread in parse_dump(text):
            by_thread.setdefault(thread.thread_id, []).append(thread)
    motions = []
    for thread_id, seen in by_thread.items():
        still = len(seen) == len(texts) > 1 and len({t.position for t in seen}) == 1
        motions.append(ThreadMotion(thread_id, seen[-1].name, tuple(t.state for t in seen), len(seen), len(texts),
                                    still, seen[-1].frames))
    return sorted(motions, key=lambda m: not m.still)
