"""A stand-in for a vLLM engine's HTTP API, for the operator tools' tests and demos.

Serves ``/v1/completions``, ``/v1/models``, ``/health``, ``/tokenize``,
``/metrics``, ``/start_profile``, ``/stop_profile`` and ``/reset_prefix_cache``
on 127.0.0.1 (or another loopback ``host``), from a background thread.

How a completion behaves:

- A prompt that starts with ``@plan key=value ...`` on its first line follows
  that plan (tests): ``ttft`` seconds to the first token, ``chunks`` text
  chunks ``gap`` seconds apart, ``status`` (HTTP status), ``empty`` choices
  events with empty text sent at ``ttft``, ``gap`` seconds before the first text
  (a token that detokenizes to ""), ``usage`` (0: no usage event), ``tokens``
  (completion_tokens reported in usage), ``malformed`` (``notjson``,
  ``nodone``, ``nochoices`` or ``json``: a plain JSON body), ``error`` (1: an
  error event instead of text), ``close`` (1: drop the connection after the
  first chunk), ``ctype`` (``json``: stream with Content-Type
  ``application/json``, as vLLM's P/D toy proxy relays streams).
- Any other prompt is served by a simulated prefill engine: one prefill at a
  time (FIFO), ``prefill_rate`` tokens/s for tokens not in its cache and
  ``load_rate`` tokens/s for cached ones (a KV-connector cache of 256-token
  chunks of the fake tokenizer's tokens; ``cache_serves=False``
  makes every lookup miss, like a wrong ``remote_url``), then one chunk per
  output token every ``decode_gap`` seconds. A prompt containing a needle
  (``secret code is XXXX-XXXX``) is answered with the code (or a wrong one when
  ``needle_answer='wrong'``). The connector's hits are counted on ``/metrics``
  under vLLM 0.31.0's names (``vllm:external_prefix_cache_hits_total``,
  ``..._queries_total``), and reported as ``usage.prompt_tokens_details.
  cached_tokens`` unless ``report_cached_tokens`` is off (vLLM without
  ``--enable-prompt-tokens-details``).
- ``stream: false`` (the P/D proxy's prefill call) gets one JSON completion with
  ``kv_transfer_params``; a request carrying ``kv_transfer_params`` with
  ``do_remote_prefill`` (the proxy's decode call) is not prefilled: all its
  prompt tokens count as external hits on ``/metrics``, as NIXL's transfer does
  on a decode engine, while its usage ``cached_tokens`` is the prefill's own
  count, which the prefill returned as ``remote_prefill_cached_tokens`` (vLLM
  0.31.0: v1/core/sched/scheduler.py, v1/engine/output_processor.py). So two
  fake engines behind vLLM's toy proxy act as a P/D cell.
  The prefill's ``kv_transfer_params`` carry ``remote_request_id``, the
  engine's id for the request: ``cmpl-<X-Request-Id>-<8 hex>`` as vLLM 0.31.0
  derives it (entrypoints/openai/completion/serving.py:141,
  v1/engine/input_processor.py:338).
- Shutdown as vLLM 0.31.0's ``serve_http`` does it
  (entrypoints/launchers/launcher.py; v1/engine/core.py ``_handle_shutdown``,
  ``_reject_add_in_shutdown``): after ``begin_drain()`` (the CLI's SIGTERM with
  ``--shutdown-timeout`` > 0) ``/health`` still answers 200
  (``AsyncLLM.check_health`` only fails on a dead engine), a new completion is
  finished at once with ``finish_reason: "abort"`` (200, no text, no
  ``kv_transfer_params``), and requests already in flight run to the end; with
  ``--shutdown-timeout 0`` (vLLM's default, ``begin_drain(abort=True)``) those
  are finished the same way instead (a prefill not yet answered, or a stream at
  its next chunk). The CLI's ``--arrivals-log`` records every arrival, finish
  and abort as a JSON line, for tests that run engines as processes.

Run it alone for a demo: ``python -m tests.ops.fake_engine --port 8000``.
:func:`start_engine_process` runs it so for tests, on a free port, with its
arrivals log.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

CHUNK_TOKENS = 256
NEEDLE = re.compile(r"secret code is ([A-Z0-9]{4}-[A-Z0-9]{4})")
TOKEN = re.compile(r"\w+|[^\w\s]")


def fake_tokens(text: str) -> list[str]:
    """The fake tokenizer: BOS + one token per word or punctuation mark, two for words over 7 characters."""
    tokens = ["<bos>"]
    for piece in TOKEN.findall(text):
        tokens.extend((piece, piece + "##") if len(piece) > 7 else (piece,))
    return tokens


async def shutdown_runner(runner: web.AppRunner) -> None:
    """Stop an aiohttp app run on its own loop, then cancel what is left on that loop."""
    await runner.cleanup()
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def fake_token_id(token: str) -> int:
    """A stable id per fake token, so equal prefixes have equal ids (a prefix-aware router sees them)."""
    return int.from_bytes(hashlib.sha256(token.encode()).digest()[:4], "big") % 151_552


def fake_token_count(text: str) -> int:
    return len(fake_tokens(text))


@dataclass
class Plan:
    ttft: float = 0.01
    chunks: int = 3
    gap: float = 0.01
    status: int = 200
    empty: int = 0
    usage: int = 1
    tokens: int | None = None
    malformed: str = ""
    error: int = 0
    close: int = 0
    ctype: str = ""


def parse_plan(prompt: str) -> Plan | None:
    if not prompt.startswith("@plan"):
        return None
    plan = Plan()
    first_line = prompt.split("\n", 1)[0]
    for item in first_line.split()[1:]:
        key, _, value = item.partition("=")
        current = getattr(plan, key)
        if key in ("malformed", "ctype"):
            setattr(plan, key, value)
        elif isinstance(current, float):
            setattr(plan, key, float(value))
        else:
            setattr(plan, key, int(value))
    return plan


@dataclass
class Arrival:
    monotonic_s: float
    path: str
    body: dict[str, Any]
    request_id: str = ""  # the X-Request-Id header, "" without one


@dataclass
class FakeEngine:
    prefill_rate: float = 200_000.0
    load_rate: float = 2_000_000.0
    decode_gap: float = 0.02
    model: str = "fake-glm"
    needle_answer: str = "correct"
    profiling_enabled: bool = True
    cache_serves: bool = True
    report_cached_tokens: bool = True
    metrics_enabled: bool = True
    stream_content_type: str = "text/event-stream"
    port: int = 0
    host: str = "127.0.0.1"  # any loopback address (127.0.0.0/8), so several engines can share a port
    arrivals_log: str = ""  # if set, one JSON line per completion arrival and finish, for tests across processes
    arrivals: list[Arrival] = field(default_factory=list)
    profile_calls: list[tuple[str, float]] = field(default_factory=list)
    tokenize_calls: int = 0
    external_hits: int = 0
    external_queries: int = 0

    def __post_init__(self) -> None:
        self._cache: set[bytes] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._prefill_lock: asyncio.Lock | None = None
        self.draining = False
        self.in_flight = 0
        self._abort = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle -------------------------------------------------------
    def start(self) -> FakeEngine:
        self._thread = threading.Thread(target=self._serve, name="fake-engine", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("fake engine did not start")
        return self

    def stop(self) -> None:
        if self._loop is None or self._runner is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            future.result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            self._runner = None

    async def _shutdown(self) -> None:
        assert self._runner is not None
        await shutdown_runner(self._runner)

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._prefill_lock = asyncio.Lock()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/start_profile", self._profile)
        app.router.add_post("/stop_profile", self._profile)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._started.set()
        loop.run_forever()
        loop.close()

    # -- handlers --------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenize_calls += 1
        tokens = [fake_token_id(token) for token in fake_tokens(body["prompt"])]
        return web.json_response({"count": len(tokens), "max_model_len": 262_144, "tokens": tokens})

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.metrics_enabled:
            return web.Response(status=404, text="Not Found")
        labels = f'engine="0",model_name="{self.model}"'
        text = (
            "# HELP vllm:external_prefix_cache_queries_total External prefix cache queries from KV connector\n"
            "# TYPE vllm:external_prefix_cache_queries_total counter\n"
            f"vllm:external_prefix_cache_queries_total{{{labels}}} {float(self.external_queries)}\n"
            "# HELP vllm:external_prefix_cache_hits_total External prefix cache hits from KV connector\n"
            "# TYPE vllm:external_prefix_cache_hits_total counter\n"
            f"vllm:external_prefix_cache_hits_total{{{labels}}} {float(self.external_hits)}\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{{{labels}}} 0.0\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def _profile(self, request: web.Request) -> web.Response:
        if not self.profiling_enabled:
            return web.json_response({"detail": "Not Found"}, status=404)
        self.profile_calls.append((request.path, time.monotonic()))
        return web.Response(status=200)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.profile_calls.append((request.path, time.monotonic()))
        return web.json_response({"success": True})

    def begin_drain(self, abort: bool = False) -> None:
        """Stop admitting completions as vLLM 0.31.0 does on SIGTERM; ``abort`` (its --shutdown-timeout 0)
        also finishes the requests in flight with ``finish_reason: "abort"``."""
        self.draining = True
        if abort and self._loop is not None:
            self._loop.call_soon_threadsafe(self._abort.set)

    def _log(self, event: str, arrived: float, request_id: str, body: dict[str, Any]) -> None:
        if not self.arrivals_log:
            return
        transfer = body.get("kv_transfer_params") or {}
        record = {"event": event, "t": arrived, "now": time.monotonic(), "port": self.port,
                  "request_id": request_id, "prefill": bool(transfer.get("do_remote_decode")),
                  "decode": bool(transfer.get("do_remote_prefill")), "draining": self.draining,
                  "prompt_head": str(body.get("prompt", ""))[:40]}
        with open(self.arrivals_log, "a", encoding="utf-8") as log:
            log.write(json.dumps(record) + "\n")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        body = await request.json()
        request_id = request.headers.get("X-Request-Id", "")
        self.arrivals.append(Arrival(arrived, request.path, body, request_id))
        self._log("arrive", arrived, request_id, body)
        if self.draining:
            self._log("abort", arrived, request_id, body)
            return await self._aborted(request, body)
        self.in_flight += 1
        try:
            prompt = body.get("prompt")
            plan = parse_plan(prompt) if isinstance(prompt, str) else None
            if plan is not None:
                return await self._planned(request, body, plan, arrived)
            if body.get("stream"):
                response = await self._simulated(request, body)
            else:  # nothing is sent before the end, so an abort can still answer instead
                work = asyncio.ensure_future(self._simulated(request, body))
                abort = asyncio.ensure_future(self._abort.wait())
                await asyncio.wait({work, abort}, return_when=asyncio.FIRST_COMPLETED)
                abort.cancel()
                if not work.done():
                    work.cancel()
                    self._log("abort", arrived, request_id, body)
                    return await self._aborted(request, body)
                response = work.result()
            self._log("finish", arrived, request_id, body)
            return response
        finally:
            self.in_flight -= 1

    async def _aborted(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-fake", "object": "text_completion", "model": self.model,
                "choices": [{"index": 0, "text": "", "finish_reason": "abort"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                "kv_transfer_params": None,
            })
        response = await self._open_stream(request)
        await response.write(self._chunk("", "abort"))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def _chunk(text: str, finish: str | None = None) -> bytes:
        event = {"id": "cmpl-fake", "object": "text_completion", "model": "fake",
                 "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        return f"data: {json.dumps(event)}\n\n".encode()

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> bytes:
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return f"data: {json.dumps({'id': 'cmpl-fake', 'choices': [], 'usage': usage})}\n\n".encode()

    async def _open_stream(self, request: web.Request, content_type: str = "") -> web.StreamResponse:
        response = web.StreamResponse(status=200,
                                      headers={"Content-Type": content_type or self.stream_content_type})
        await response.prepare(request)
        return response

    async def _planned(
        self, request: web.Request, body: dict[str, Any], plan: Plan, arrived: float
    ) -> web.StreamResponse:
        if plan.status != 200:
            await asyncio.sleep(plan.ttft)
            return web.json_response({"error": {"message": f"planned status {plan.status}"}}, status=plan.status)
        if plan.malformed == "json":
            await asyncio.sleep(plan.ttft)
            return web.json_response({"choices": [{"text": "not streamed"}]})
        response = await self._open_stream(request, "application/json" if plan.ctype == "json" else "")
        await asyncio.sleep(max(0.0, arrived + plan.ttft - time.monotonic()))
        for _ in range(plan.empty):
            await response.write(self._chunk(""))
        if plan.empty:
            await asyncio.sleep(plan.gap)
        if plan.malformed == "notjson":
            await response.write(b"data: {this is not json\n\n")
            await response.write_eof()
            return response
        if plan.malformed == "nochoices":
            await response.write(b'data: {"id": "x", "object": "text_completion"}\n\n')
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        if plan.error:
            await response.write(b'data: {"error": {"message": "planned engine error", "code": 500}}\n\n')
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        for i in range(plan.chunks):
            if i:
                await asyncio.sleep(plan.gap)
            await response.write(self._chunk(f" tok{i}", "length" if i == plan.chunks - 1 else None))
            if plan.close:
                assert request.transport is not None
                request.transport.abort()
                return response
        want_usage = plan.usage and (body.get("stream_options") or {}).get("include_usage")
        if want_usage:
            tokens = plan.tokens if plan.tokens is not None else plan.chunks
            await response.write(self._usage(len(str(body.get("prompt", "")).split()), tokens))
        if plan.malformed != "nodone":
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def _engine_request_id(request: web.Request) -> str:
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return f"cmpl-{base}-{uuid.uuid4().hex[:8]}"

    def _chunk_hashes(self, tokens: list[str]) -> list[bytes]:
        hashes = []
        running = hashlib.sha256()
        for start in range(0, len(tokens) - CHUNK_TOKENS + 1, CHUNK_TOKENS):
            running.update(" ".join(tokens[start : start + CHUNK_TOKENS]).encode())
            hashes.append(running.copy().digest())
        return hashes

    async def _simulated(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        prompt = body.get("prompt")
        tokens = [str(t) for t in prompt] if isinstance(prompt, list) else fake_tokens(str(prompt))
        hashes = self._chunk_hashes(tokens)
        max_tokens = int(body.get("max_tokens") or 16)
        transfer = body.get("kv_transfer_params") or {}
        self.external_queries += len(tokens)
        prefill_cached = transfer.get("remote_prefill_cached_tokens")
        if transfer.get("do_remote_prefill"):
            cached = len(tokens)  # the decode side: NIXL brought the whole prompt's KV
            await asyncio.sleep(cached / self.load_rate)
        else:
            assert self._prefill_lock is not None
            async with self._prefill_lock:
                cached_chunks = 0
                for digest in hashes if self.cache_serves else []:
                    if digest not in self._cache:
                        break
                    cached_chunks += 1
                cached = cached_chunks * CHUNK_TOKENS
                await asyncio.sleep((len(tokens) - cached) / self.prefill_rate + cached / self.load_rate)
                self._cache.update(hashes)
        self.external_hits += cached
        text = prompt if isinstance(prompt, str) else ""
        needle = NEEDLE.search(text)
        if needle is not None:
            answer = needle.group(1) if self.needle_answer == "correct" else "0000-0000"
            pieces = [f" {answer}", "."]
        else:
            pieces = [f" w{i}" for i in range(min(max_tokens, 64))]
        # vLLM 0.31.0's decode side reports the prefill's own hits (remote_prefill_cached_tokens, which the
        # prefill scheduler put into kv_transfer_params), not its ~100% from the transfer.
        shown = prefill_cached if transfer.get("do_remote_prefill") and isinstance(prefill_cached, int) else cached
        reported_cached = shown if self.report_cached_tokens else None
        if not body.get("stream"):
            pieces = pieces[:max_tokens]
            usage: dict[str, Any] = {"prompt_tokens": len(tokens), "completion_tokens": len(pieces),
                                     "total_tokens": len(tokens) + len(pieces)}
            if reported_cached is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": reported_cached}
            return web.json_response({
                "id": "cmpl-fake", "object": "text_completion", "model": self.model,
                "choices": [{"index": 0, "text": "".join(pieces), "finish_reason": "length"}],
                "usage": usage,
                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                       "remote_engine_id": f"fake-{self.port}", "remote_block_ids": [],
                                       "remote_request_id": self._engine_request_id(request),
                                       "remote_prefill_cached_tokens": cached,
                                       "remote_host": self.host, "remote_port": self.port, "tp_size": 1},
            })
        response = await self._open_stream(request)
        for i, piece in enumerate(pieces):
            if i:
                await asyncio.sleep(self.decode_gap)
            if self._abort.is_set():
                await response.write(self._chunk("", "abort"))
                break
            await response.write(self._chunk(piece, "length" if i == len(pieces) - 1 else None))
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(self._usage(len(tokens), len(pieces), reported_cached))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@dataclass
class EngineProcess:
    """A fake engine running as its own process (``python -m tests.ops.fake_engine``)."""

    process: subprocess.Popen[bytes]
    url: str
    arrivals_log: Path

    def events(self, event: str = "arrive") -> list[dict[str, Any]]:
        """The arrivals log's lines of one kind (``arrive``, ``finish``, ``abort``), in order."""
        if not self.arrivals_log.exists():
            return []
        lines = self.arrivals_log.read_text(encoding="utf-8").splitlines()
        return [entry for line in lines if line.strip() and (entry := json.loads(line))["event"] == event]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()


def start_engine_process(workdir: Path, *options: str, timeout_s: float = 30.0) -> EngineProcess:
    """Start the fake engine as a process on a free loopback port; ``options`` are its CLI's."""
    log = workdir / f"arrivals-{uuid.uuid4().hex[:8]}.jsonl"
    with open(workdir / "fake-engine.err", "ab") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.ops.fake_engine", "--port", "0", "--arrivals-log", str(log), *options],
            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, stderr=stderr,
        )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    line = process.stdout.readline().decode() if ready else ""
    if not line.startswith("fake engine on "):
        process.kill()
        process.wait(10)
        raise RuntimeError(f"the fake engine process did not start (said {line!r}; see {workdir}/fake-engine.err)")
    return EngineProcess(process, line.split()[-1], log)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the fake engine on 127.0.0.1 until Ctrl-C.")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1", help="a loopback address to listen on")
    parser.add_argument("--prefill-rate", type=float, default=200_000.0, help="uncached tokens/s")
    parser.add_argument("--load-rate", type=float, default=2_000_000.0, help="cached tokens/s")
    parser.add_argument("--decode-gap", type=float, default=0.02)
    parser.add_argument("--arrivals-log", default="", help="append one JSON line per completion arrival/finish here")
    parser.add_argument("--shutdown-timeout", type=float, default=0.0,
                        help="as vLLM's: on SIGTERM, 0 exits at once, >0 drains in-flight requests up to this long")
    args = parser.parse_args()
    engine = FakeEngine(prefill_rate=args.prefill_rate, load_rate=args.load_rate, decode_gap=args.decode_gap,
                        port=args.port, host=args.host, arrivals_log=args.arrivals_log).start()
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: terminated.set())
    print(f"fake engine on {engine.url}", flush=True)
    try:
        terminated.wait()
    except KeyboardInterrupt:
        pass
    engine.begin_drain(abort=args.shutdown_timeout == 0)
    deadline = time.monotonic() + (args.shutdown_timeout or 5.0)  # abort: time to send the aborted answers
    while engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.stop()


if __name__ == "__main__":
    main()
