"""``scripts/needle``: needle-in-a-haystack answers cold, from L1, from L2 after a restart, and cold again."""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import (
    EXIT_FAILED,
    EXIT_OK,
    HelpFormatter,
    OpsError,
    fail,
    positive_float,
    positive_int,
    prepare_out_dir,
    run_guarded,
)
from .needle import DEFAULT_LENGTHS, FittedPrompt, answer_has_code, fit_prompt, make_specs

TOOL = "needle"

PHASES = ("cold", "l1", "l2", "cold-again")
SERVED_PHASES = ("l1", "l2")  # must be served from cache, with evidence
PHASE_MEANING = {
    "cold": "first sight of the prompt (fresh salt): computed, then stored in L1 and L2",
    "l1": "the same prompt again: loaded from LMCache's CPU tier",
    "l2": "the same prompt after an engine restart: L1 is gone, loaded from Valkey",
    "cold-again": "the prompt with a second fresh salt: computed again, the control",
}

DESCRIPTION = """\
Needle-in-a-haystack correctness check of the KV cache tiers. For each length, a
seeded prompt hides a random code at a random depth; its exact token length comes
from the server's /tokenize. Each prompt is answered in four phases:

  cold        a salt never used before, so no prefix is cached anywhere
  l1          the identical prompt: LMCache L1 (CPU) serves the prefix
  l2          after you restart the engine (Valkey keeps running): L2 serves it
  cold-again  a second fresh salt: computed again, as a control

Phases l1 and l2 pass only with evidence that the cache served the prompt:
the engines' KV-connector hit counter (vllm:external_prefix_cache_hits on
/metrics) rose by at least the prompt minus one chunk, or, where no engine
serves that counter, the answer's usage reports that many cached tokens (vLLM
sends cached_tokens only with --enable-prompt-tokens-details). Otherwise the
phase fails and says which evidence was missing.

Through a front end (vLLM's P/D toy proxy) that has no /tokenize, /health or
/metrics, pass --engine-url of a prefill engine (tokenizer, model list,
health, prefix-cache reset) and --metrics-url of every prefill engine: the
cached_tokens the proxy passes on are the prefill engine's (vLLM 0.31.0 returns
them as remote_prefill_cached_tokens), vLLM's GPU prefix cache included, so
only the connector's counter separates LMCache's hits.

"Cold" works because the salt is the prompt's first line: vLLM's prefix cache
and LMCache hash every block/chunk together with all tokens before it, so a
new first line changes every hash. The run pauses before phase l2 and asks you
to restart the engine (--skip-restart leaves l2 out). Start vLLM with
--no-enable-prefix-caching, or pass --reset-prefix-cache (needs
VLLM_SERVER_DEV_MODE=1), so phase l1 is not served from GPU memory instead.

example:
  scripts/needle --url http://127.0.0.1:8000 --lengths 12800,65536,166656 --seed 3 --out work/ops/needle
  scripts/needle --url http://proxy:8000 --engine-url http://prefill-0:8000 \
      --metrics-url http://prefill-0:8000,http://prefill-1:8000 --skip-restart
"""

EPILOG = """\
outputs in --out: prompts.jsonl (the fitted prompts: salt, code, depth, tokens, text),
results.csv (one row per prompt and phase), summary.json. Exit: 0 every answer found
(and phases l1/l2 served from cache), 1 a code not found, a request failed or a cached
phase without evidence, 2 error (endpoint, tokenizer, bad value), 130 interrupted.
"""


def lengths_list(text: str) -> list[int]:
    try:
        values = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not values or any(v < 64 for v in values):
        raise argparse.ArgumentTypeError(f"expected token counts >= 64, got {text!r}")
    return values


def url_list(text: str) -> list[str]:
    urls = [part.strip() for part in text.split(",") if part.strip()]
    if not urls or any("://" not in u for u in urls):
        raise argparse.ArgumentTypeError(f"expected http:// URLs, comma-separated, got {text!r}")
    return urls


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=TOOL, description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    parser.add_argument("--url", required=True, help="base URL of the completions endpoint (engine or front end), "
                                                     "e.g. http://127.0.0.1:8000")
    parser.add_argument("--engine-url", help="base URL of an engine for /tokenize, /v1/models, /health, "
                                             "/reset_prefix_cache (default: --url)")
    parser.add_argument("--metrics-url", type=url_list, action="extend", default=None, metavar="URL[,URL]",
                        help="engines whose vllm:external_prefix_cache_hits counter is the evidence (repeat or "
                             "comma-separate; default: the engine's /metrics, if it serves the counter)")
    parser.add_argument("--chunk-tokens", type=positive_int, default=256,
                        help="LMCache chunk size: a cached phase must be served but this many tokens")
    parser.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    parser.add_argument("--lengths", type=lengths_list, default=list(DEFAULT_LENGTHS), metavar="N,N,...",
                        help="prompt lengths in tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of codes, depths and filler")
    parser.add_argument("--salt", help="salt (default: random per run); the first three phases use "
                                       "SALT-first, cold-again uses SALT-again")
    parser.add_argument("--phases", default=",".join(PHASES), metavar="P,P,...",
                        help=f"phases to run, in order, from {','.join(PHASES)}")
    parser.add_argument("--skip-restart", action="store_true", help="do not pause for a restart; leave phase l2 out")
    parser.add_argument("--restart-timeout", type=positive_float, default=1800.0, metavar="S",
                        help="how long to wait for the engine to serve again after the restart")
    parser.add_argument("--reset-prefix-cache", action="store_true",
                        help="POST /reset_prefix_cache before phase l1 (vLLM dev mode)")
    parser.add_argument("--max-answer-tokens", type=positive_int, default=24)
    parser.add_argument("--request-timeout", type=positive_float, default=1800.0, metavar="S")
    parser.add_argument("--dry-run", action="store_true", help="only fit and write the prompts; send no completion")
    parser.add_argument("--out", type=Path, help="output folder (default: work/ops/needle-<UTC time>/)")
    return parser


@dataclass
class Answer:
    prompt: FittedPrompt
    phase: str
    status: str
    found: bool
    ttft_s: float | None
    e2e_s: float | None
    cached_tokens: int | None
    prompt_tokens: int | None
    text: str
    error: str
    connector_hits: float | None = None
    evidence: str = ""  # why a cached phase counts as served (or not); "" for cold phases
    served: bool | None = None  # None: not a cached phase

    @property
    def passed(self) -> bool:
        return self.found and self.served is not False

    def row(self) -> dict[str, Any]:
        return {
            "length": self.prompt.spec.target_tokens,
            "prompt_tokens": self.prompt.tokens,
            "phase": self.phase,
            "salt": self.prompt.salt,
            "code": self.prompt.spec.code,
            "depth": self.prompt.spec.depth,
            "status": self.status,
            "found": "yes" if self.found else "no",
            "ttft_s": "" if self.ttft_s is None else f"{self.ttft_s:.4f}",
            "e2e_s": "" if self.e2e_s is None else f"{self.e2e_s:.4f}",
            "cached_tokens": "" if self.cached_tokens is None else self.cached_tokens,
            "connector_hits": "" if self.connector_hits is None else int(self.connector_hits),
            "served_from_cache": "" if self.served is None else ("yes" if self.served else "no"),
            "evidence": self.evidence,
            "answer": self.text.strip(),
            "error": self.error,
        }


RESULT_COLUMNS = ("length", "prompt_tokens", "phase", "salt", "code", "depth", "status", "found", "ttft_s",
                  "e2e_s", "cached_tokens", "connector_hits", "served_from_cache", "evidence", "answer", "error")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_phases(text: str, skip_restart: bool) -> list[str]:
    phases = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        raise OpsError(f"--phases {text!r}: unknown {unknown}; choose from {','.join(PHASES)}")
    if skip_restart and "l2" in phases:
        phases.remove("l2")
    return phases


async def wait_until_serving(http: Any, base_url: str, timeout_s: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    url = base_url.rstrip("/") + "/health"
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            last = type(exc).__name__
        await asyncio.sleep(2)
    raise OpsError(f"{url}: the engine did not serve again within {timeout_s:g} s (last: {last})")


async def _hit_counter(http: Any, args: argparse.Namespace, engine_url: str) -> Any:
    """The connector hit counter to judge cached phases by, or None (then usage's cached_tokens)."""
    from .cache_evidence import HITS_METRIC, HitCounter

    if args.metrics_url:
        counter = HitCounter(http, args.metrics_url)
        await counter.require()
        return counter
    counter = HitCounter(http, [engine_url])
    if await counter.read() is not None:
        return counter
    _say(f"needle: {counter.urls[0]} serves no {HITS_METRIC} counter; phases l1/l2 are judged by the answers' "
         "usage cached_tokens (vLLM needs --enable-prompt-tokens-details; through a P/D proxy they are the prefill "
         "engine's own hits, vLLM's prefix cache included: pass --metrics-url of the prefill engines for the "
         "connector's alone)")
    return None


async def _fit_all(
    args: argparse.Namespace, http: Any, engine_url: str, model: str, salts: dict[str, str]
) -> dict[str, list[FittedPrompt]]:
    from .tokenizer_client import TokenizerClient

    tokenizer = TokenizerClient(http, engine_url, model)
    specs = make_specs(args.lengths, args.seed)
    fitted: dict[str, list[FittedPrompt]] = {}
    for salt_name, salt in salts.items():
        fitted[salt_name] = []
        for index, spec in enumerate(specs):
            like = fitted["first"][index] if salt_name != "first" else None
            prompt = await fit_prompt(spec, salt, tokenizer.count, like=like)
            note = "" if prompt.exact else f" (closest reachable; {prompt.tokens - spec.target_tokens:+d})"
            _say(f"needle: fitted {spec.target_tokens} tokens with salt {salt}: {prompt.tokens} tokens, "
                 f"code at depth {spec.depth:.2f}, {prompt.tokenize_calls} tokenize calls{note}")
            fitted[salt_name].append(prompt)
    if tokenizer.max_model_len is not None:
        too_long = [p.tokens for p in fitted["first"] if p.tokens + args.max_answer_tokens > tokenizer.max_model_len]
        if too_long:
            raise OpsError(f"--lengths: {too_long} tokens do not fit the model's max_model_len "
                           f"{tokenizer.max_model_len} with {args.max_answer_tokens} answer tokens")
    return fitted


async def _ask(http: Any, args: argparse.Namespace, model: str, prompt: FittedPrompt, phase: str,
               counter: Any) -> Answer:
    from .cache_evidence import judge
    from .completions import stream_completion
    from .records import RequestRecord

    before = await counter.read() if counter is not None else None
    record = RequestRecord(id=f"{phase}-{prompt.spec.target_tokens}", offset_s=0.0)
    body = {
        "model": model, "prompt": prompt.text, "max_tokens": args.max_answer_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    await stream_completion(http, args.url.rstrip("/") + "/v1/completions", body, record, time.monotonic(),
                            args.request_timeout, keep_text=True)
    found = record.ok and answer_has_code(record.text, prompt.spec.code)
    answer = Answer(prompt, phase, record.status, found, record.ttft_s, record.e2e_s, record.cached_tokens,
                    record.prompt_tokens, record.text, record.error)
    if before is not None:
        needed = prompt.tokens - args.chunk_tokens
        for attempt in range(4):  # the engine may count a step's hits just after the answer ends
            after = await counter.read()
            answer.connector_hits = None if after is None else after - before
            if answer.connector_hits is None or answer.connector_hits >= needed or attempt == 3:
                break
            await asyncio.sleep(0.5)
    if phase in SERVED_PHASES:
        verdict = judge(prompt.tokens, args.chunk_tokens, answer.connector_hits, record.cached_tokens,
                        ", ".join(counter.urls) if counter is not None else "no engine")
        answer.served, answer.evidence = verdict.served, verdict.detail
    return answer


async def _run(args: argparse.Namespace, out: Path, phases: list[str], answers: list[Answer]) -> None:
    """Fit the prompts and run the phases; ``answers`` grows as they come (kept on errors)."""
    import aiohttp

    from .replay import resolve_model

    salt = args.salt or "n" + secrets.token_hex(6)
    salts = {"first": f"{salt}-first", "again": f"{salt}-again"}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    engine_url = args.engine_url or args.url
    async with aiohttp.ClientSession(timeout=timeout) as http:
        model = await resolve_model(http, engine_url, args.model, 10.0)
        counter = await _hit_counter(http, args, engine_url)
        if "cold-again" not in phases:
            salts.pop("again")
        fitted = await _fit_all(args, http, engine_url, model, salts)
        with (out / "prompts.jsonl").open("w", encoding="utf-8") as handle:
            for prompts in fitted.values():
                for p in prompts:
                    handle.write(json.dumps({
                        "length": p.spec.target_tokens, "tokens": p.tokens, "exact": p.exact, "salt": p.salt,
                        "code": p.spec.code, "depth": p.spec.depth, "filler_words": p.filler_words,
                        "pad_words": p.pad_words, "seed": args.seed, "prompt": p.text,
                    }) + "\n")
        if args.dry_run:
            return
        for phase in phases:
            if phase == "l1" and args.reset_prefix_cache:
                url = engine_url.rstrip("/") + "/reset_prefix_cache"
                async with http.post(url) as resp:
                    if resp.status != 200:
                        raise OpsError(f"{url}: HTTP {resp.status}; start vLLM with VLLM_SERVER_DEV_MODE=1 "
                                       "or drop --reset-prefix-cache")
            if phase == "l2":
                _say("\nneedle: phase l2 needs an engine restart. Restart the vLLM engine now (its L1 CPU cache "
                     "goes with it; keep Valkey running so L2 survives), wait until it loads, then press Enter.")
                print("needle: press Enter when restarted> ", end="", file=sys.stderr, flush=True)
                line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
                if not line:
                    raise OpsError("phase l2: no operator input (stdin is closed); pass --skip-restart "
                                   "or run interactively")
                await wait_until_serving(http, engine_url, args.restart_timeout)
            prompts = fitted["again" if phase == "cold-again" else "first"]
            _say(f"needle: phase {phase}: {PHASE_MEANING[phase]}")
            for prompt in prompts:
                answer = await _ask(http, args, model, prompt, phase, counter)
                answers.append(answer)
                ttft = f"{answer.ttft_s:.2f} s" if answer.ttft_s is not None else "-"
                verdict = "found" if answer.found else "NOT FOUND"
                if answer.served is False:
                    verdict += ", NOT SERVED FROM CACHE"
                detail = f" ({answer.error})" if answer.error else ""
                if answer.served is False:
                    detail += f" [{answer.evidence}]"
                _say(f"  {prompt.tokens:>7} tokens  {phase:<10} TTFT {ttft:>9}  {verdict}: "
                     f"{answer.text.strip()[:40]!r}{detail}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(TOOL, lambda: _ask_and_report(args), "interrupted; answers so far are in results.csv")


def _ask_and_report(args: argparse.Namespace) -> int:
    phases = parse_phases(args.phases, args.skip_restart)
    out = prepare_out_dir(args.out, TOOL)
    answers: list[Answer] = []
    try:
        asyncio.run(_run(args, out, phases, answers))
    finally:
        _write_results(out, answers)
    if args.dry_run:
        print(f"wrote {out / 'prompts.jsonl'} ({len(args.lengths)} lengths); no completion sent (--dry-run)")
        return EXIT_OK
    _print_answers(answers, phases, out)
    return _verdict(answers)


def _print_answers(answers: list[Answer], phases: list[str], out: Path) -> None:
    print(f"{'tokens':>8} " + " ".join(f"{p:>10}" for p in phases))
    by_length: dict[int, dict[str, Answer]] = {}
    for answer in answers:
        by_length.setdefault(answer.prompt.spec.target_tokens, {})[answer.phase] = answer
    for length, row in by_length.items():
        cells = [_cell(row[p]) if p in row else "-" for p in phases]
        print(f"{length:>8} " + " ".join(f"{c:>10}" for c in cells))
    found = sum(a.found for a in answers)
    print(f"{found} of {len(answers)} answers found; written: {out}/results.csv, prompts.jsonl, summary.json")
    for answer in answers:
        if answer.found and answer.served is False:
            print(f"{answer.prompt.spec.target_tokens}/{answer.phase}: {answer.evidence}")


def _verdict(answers: list[Answer]) -> int:
    missing = [a for a in answers if not a.found]
    unserved = [a for a in answers if a.found and a.served is False]
    problems = []
    if missing:
        problems.append(f"{len(missing)} answer(s) without the code: "
                        + ", ".join(f"{a.prompt.spec.target_tokens}/{a.phase}" for a in missing))
    if unserved:
        problems.append(f"{len(unserved)} cached-phase answer(s) not served from cache: "
                        + ", ".join(f"{a.prompt.spec.target_tokens}/{a.phase}" for a in unserved))
    if problems:
        return fail("; ".join(problems), EXIT_FAILED, TOOL)
    return EXIT_OK


def _cell(answer: Answer) -> str:
    if not answer.found:
        return "NOT FOUND"
    return "found" if answer.served is not False else "NO CACHE"


def _write_results(out: Path, answers: list[Answer]) -> None:
    with (out / "results.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=RESULT_COLUMNS)
        writer.writeheader()
        for answer in answers:
            writer.writerow(answer.row())
    (out / "summary.json").write_text(json.dumps({
        "answers": len(answers),
        "found": sum(a.found for a in answers),
        "not_found": [f"{a.prompt.spec.target_tokens}/{a.phase}" for a in answers if not a.found],
        "not_served_from_cache": {f"{a.prompt.spec.target_tokens}/{a.phase}": a.evidence
                                  for a in answers if a.served is False},
        "passed": all(a.passed for a in answers),
    }, indent=2) + "\n", encoding="utf-8")
