"""``scripts/replay``: open-loop request replay with TTFT gates, rate sweeps, and a stream generator."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import gates as gate_rules
from .common import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    HelpFormatter,
    OpsError,
    dispatch,
    fail,
    fraction,
    positive_float,
    positive_int,
    prepare_out_dir,
    utc_iso,
)
from .records import RequestRecord

if TYPE_CHECKING:
    from .replay import ReplayConfig
    from .stats import ReplaySummary
    from .stream import StreamRequest

TOOL = "replay"
SWEEP_OUT = "replay-sweep"

DESCRIPTION = """\
Replay a JSONL request stream against an OpenAI-compatible endpoint, open loop
(each request is sent at its offset, however slow the server), and judge the
TTFT against SLA gates. Reads replay's own stream format, Mooncake traces and
AIPerf fixed-schedule traces (scripts/README.md; the docstrings of
scripts/opstools/stream.py and trace_*.py).

  replay run STREAM --url URL             replay, report, gate (exit 0 pass, 1 gate failed, 2 error)
  replay sweep STREAM --url URL --rates   the stream at each rate, one result per rate and a table
  replay generate --count N ...           write a synthetic stream
  replay report RECORDS.csv               judge an earlier run again, with other gates

example:
  scripts/replay generate --count 450 --rate 1.2 --reuse-share 0.9 --seed 7 --out work/ops/hit-heavy
  scripts/replay run work/ops/hit-heavy/stream.jsonl --url http://127.0.0.1:8000 --out work/ops/replay-hh
"""

RUN_EPILOG = """\
outputs in --out: records.csv (one row per request), summary.json, result.json (vllm bench
serve --save-result's keys), ttft_over_time.png, ttft_cdf.png, in_flight.png, throughput.png.
Through a front end without GET /v1/models (vLLM's P/D toy proxy) pass --model. Exit: 0 all
gates pass, 1 a gate failed, 2 error (bad stream, dead endpoint, malformed event stream,
--abort-after-errors failures of one kind in a row; records taken so far are still written),
130 interrupted (records kept).

example:
  scripts/replay run stream.jsonl --url http://127.0.0.1:8000 --gate-p90 60 --gate-p99 off
  scripts/replay run stream.jsonl --url http://proxy:8000 --model zai-org/GLM-5.3-FP8 --nodes 5 \
      --gate-output-tps 30 --goodput ttft:30000,tpot:100
  scripts/replay run mooncake_trace.jsonl --url http://127.0.0.1:8000 --metric-percentiles 50,90,99.9
  scripts/replay run stream.jsonl --url http://127.0.0.1:8000 --request-rate 2 --max-concurrency 64
"""

SWEEP_EPILOG = """\
Runs the stream once per rate (its send times scaled to that mean arrival rate, as
--request-rate does), each into --out/rate-<R>/ with run's outputs, then prints a table and
writes sweep.json and sweep.csv. The engine's prefix cache stays warm from one rate to the
next. Exit: 0 every rate passed the gates, 1 some rate failed one, 2 error (the sweep stops at
the rate that hit it), 130 interrupted.

example:
  scripts/replay sweep stream.jsonl --url http://127.0.0.1:8000 --rates 0.5,1,2,4 --gate-p90 60
"""

REPORT_EPILOG = """\
Reads the records.csv of an earlier run, prints the report, writes summary.json, result.json
and the PNGs into --out. Exit 0 pass, 1 a gate failed, 2 error (a file that is not a replay
records.csv).

example:
  scripts/replay report work/ops/replay-hh/records.csv --gate-p90 60 --gate-p99 120 --out work/ops/rejudged
"""

GENERATE_EPILOG = """\
Prompts are sentences of common English words, about one token per word plus one per
sentence; --tokenize-url measures the real ratio with the server's /tokenize.
Fresh prompts start with a unique "[salt-index]" tag, so reuse-share 0 is a cold stream.

examples:
  scripts/replay generate --count 683 --rate 1.8 --reuse-share 0 --out work/ops/cold
  scripts/replay generate --count 200 --rate 0.5 --length-histogram 9000-16000:50,16000-64000:30,64000-200000:20
"""


def gate_limit(text: str) -> float | None:
    """argparse type: a limit > 0, or ``off``."""
    if text.lower() in ("off", "none"):
        return None
    return positive_float(text)


def success_limit(text: str) -> float | None:
    if text.lower() in ("off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage in [0, 100] or 'off', got {text!r}") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"expected a percentage in [0, 100] or 'off', got {text!r}")
    return value


def goodput_slos(text: str) -> dict[str, float]:
    """argparse type: ``ttft:30000,tpot:50`` (milliseconds)."""
    from .stats import GOODPUT_KEYS

    slos: dict[str, float] = {}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise argparse.ArgumentTypeError(
                f"expected KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}, got {item!r}")
        try:
            limit = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key}: expected milliseconds, got {value!r}") from None
        if not limit > 0:
            raise argparse.ArgumentTypeError(f"{key}: expected milliseconds > 0, got {value!r}")
        slos[key] = limit
    if not slos:
        raise argparse.ArgumentTypeError(f"no SLO in {text!r}")
    return slos


def request_rate(text: str) -> float:
    """argparse type: requests/s > 0, or ``inf`` (everything at once), as vllm bench serve --request-rate."""
    if text.lower() in ("inf", "infinity"):
        return math.inf
    return positive_float(text)


def request_rates(text: str) -> list[float]:
    rates = [request_rate(item) for item in text.replace(" ", ",").split(",") if item]
    if not rates:
        raise argparse.ArgumentTypeError(f"expected rates like 0.5,1,2, got {text!r}")
    return rates


def percentile_list(text: str) -> list[float]:
    """argparse type: ``50,90,99.9`` (vllm bench serve --metric-percentiles)."""
    values = []
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected percentiles like 50,90,99, got {item!r}") from None
        if not 0 < value <= 100:
            raise argparse.ArgumentTypeError(f"a percentile must be in (0, 100], got {item!r}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"no percentile in {text!r}")
    return values


def metric_list(text: str) -> list[str]:
    """argparse type: ``ttft,tpot,itl`` (vllm bench serve --percentile-metrics)."""
    from .stats import PERCENTILE_METRICS

    names = [item for item in text.replace(" ", ",").split(",") if item]
    unknown = [name for name in names if name not in PERCENTILE_METRICS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected metrics among {', '.join(PERCENTILE_METRICS)}, got {text!r}")
    return list(dict.fromkeys(names))


def errors_limit(text: str) -> int | None:
    if text.lower() in ("off", "none"):
        return None
    return positive_int(text)


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add_gate_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gate-p90", type=gate_limit, default=gate_rules.DEFAULT_P90_S, metavar="S",
                        help="TTFT P90 must be below S seconds ('off' to skip)")
    parser.add_argument("--gate-p50", type=gate_limit, default=gate_rules.DEFAULT_P50_S, metavar="S",
                        help="TTFT P50 must be below S seconds")
    parser.add_argument("--gate-mean", type=gate_limit, default=gate_rules.DEFAULT_MEAN_S, metavar="S",
                        help="mean TTFT must be below S seconds")
    parser.add_argument("--gate-p99", type=gate_limit, default=None, metavar="S",
                        help="TTFT P99 must be below S seconds (off by default)")
    parser.add_argument("--gate-success", type=success_limit, default=gate_rules.DEFAULT_SUCCESS_PCT,
                        metavar="PCT", help="share of the stream's requests that must succeed, in percent")
    parser.add_argument("--gate-output-tps", type=gate_limit, default=None, metavar="TOK_S",
                        help="aggregate output tokens/s must be at least TOK_S (off by default; the "
                             "write-up's benchmark floor is 30)")
    parser.add_argument("--nodes", type=positive_int, default=None, metavar="N",
                        help="nodes of the deployment: also report tokens per minute per node")
    parser.add_argument("--goodput", type=goodput_slos, default={}, metavar="KEY:MS[,KEY:MS]",
                        help="count requests within these SLOs, in milliseconds, keys ttft, tpot, e2el "
                             "(as vllm bench serve --goodput), e.g. ttft:30000,tpot:50")
    parser.add_argument("--send-lag-warn", type=positive_float, default=0.25, metavar="S",
                        help="warn when the send lag p99 exceeds S seconds (the client fell behind)")
    parser.add_argument("--metric-percentiles", "--percentiles", type=percentile_list, default="50,90,99",
                        metavar="Q[,Q]", help="percentiles of the latency table and result.json, as vllm bench "
                                              "serve --metric-percentiles, e.g. 50,90,99.9")
    parser.add_argument("--percentile-metrics", type=metric_list, default="ttft,tpot,itl,e2el",
                        metavar="M[,M]", help="metrics of the latency table and result.json, as vllm bench serve "
                                              "--percentile-metrics: ttft, tpot, itl, e2el, client_queue_time, "
                                              "e2el_including_client_queue")


def _add_replay_options(parser: argparse.ArgumentParser, out_name: str) -> None:
    """What run and sweep share: the stream, the endpoint, the gates and the client's limits."""
    from .trace_formats import FORMATS

    parser.add_argument("stream", type=Path, help="the JSONL request stream or trace")
    parser.add_argument("--url", required=True, help="base URL of the engine, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--out", type=Path, help=f"output folder (default: work/ops/{out_name}-<UTC time>/)")
    parser.add_argument("--format", choices=FORMATS, default="auto",
                        help="stream (replay's own), mooncake (Mooncake trace), aiperf (AIPerf fixed schedule); "
                             "auto tells them apart by the first line")
    parser.add_argument("--default-max-tokens", type=positive_int, default=None, metavar="N",
                        help="max_tokens of an AIPerf trace line without output_length")
    parser.add_argument("--trace-salt", default="", metavar="TEXT",
                        help="mixed into the text built from a trace's hash ids, so a replay after another "
                             "finds no cached prefix of it")
    _add_gate_options(parser)
    parser.add_argument("--max-concurrency", type=positive_int, default=None, metavar="N",
                        help="at most N requests in flight; later sends wait for one to end (the run is then "
                             "no longer open loop), as vllm bench serve --max-concurrency")
    parser.add_argument("--request-timeout", type=positive_float, default=3600.0, metavar="S",
                        help="give up on one request after S seconds")
    parser.add_argument("--connect-timeout", type=positive_float, default=10.0, metavar="S")
    parser.add_argument("--abort-after-connect-errors", type=positive_int, default=5, metavar="N",
                        help="stop the run after N connection failures in a row")
    parser.add_argument("--abort-after-errors", type=errors_limit, default=20, metavar="N",
                        help="stop the run (exit 2) after N requests in a row fail the same way (HTTP status, "
                             "error event, no token, broken connection); 'off' never stops")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send vLLM's ignore_eos so every answer has max_tokens")
    parser.add_argument("--extra-body", type=json_object, default={}, metavar="JSON",
                        help='extra fields for every request body, e.g. \'{"temperature": 0}\'')
    parser.add_argument("--progress-interval", type=positive_float, default=5.0, metavar="S")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs (CSV and summaries only)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replay", description=DESCRIPTION, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,sweep,generate,report}")

    run = sub.add_parser("run", help="replay a stream and gate its TTFT", epilog=RUN_EPILOG,
                         formatter_class=HelpFormatter)
    _add_replay_options(run, TOOL)
    run.add_argument("--request-rate", type=request_rate, default=None, metavar="R",
                     help="scale the send times so requests arrive at R per second on average (inf: all at "
                          "once); default: the stream's own times")

    sweep = sub.add_parser("sweep", help="replay a stream at several rates, one result per rate",
                           epilog=SWEEP_EPILOG, formatter_class=HelpFormatter)
    _add_replay_options(sweep, SWEEP_OUT)
    sweep.add_argument("--rates", type=request_rates, required=True, metavar="R[,R]",
                       help="mean arrival rates to run the stream at, requests/s (inf: all at once)")

    report = sub.add_parser("report", help="judge and plot an earlier run's records.csv again",
                            epilog=REPORT_EPILOG, formatter_class=HelpFormatter)
    report.add_argument("records", type=Path, help="records.csv of an earlier run")
    _add_gate_options(report)
    report.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    report.add_argument("--out", type=Path, help="output folder (default: work/ops/replay-report-<UTC time>/)")

    gen = sub.add_parser("generate", help="write a synthetic request stream", epilog=GENERATE_EPILOG,
                         formatter_class=HelpFormatter)
    gen.add_argument("--count", type=positive_int, required=True, help="number of requests")
    gen.add_argument("--rate", type=positive_float, required=True, help="mean arrival rate, requests/s (Poisson)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--min-tokens", type=positive_int, default=9_000, help="shortest prompt (tokens)")
    gen.add_argument("--max-tokens", type=positive_int, default=200_000, help="longest prompt (tokens)")
    gen.add_argument("--length-histogram", metavar="SPEC",
                     help="LOW-HIGH:WEIGHT,... bins instead of log-uniform over [min, max]")
    gen.add_argument("--reuse-share", type=fraction, default=0.0,
                     help="share of requests that reuse an earlier prompt's prefix (0 cold, 0.9 hit-heavy)")
    gen.add_argument("--prefix-share", type=fraction, default=0.95,
                     help="share of the earlier prompt a reusing request keeps (1 = identical prompt)")
    gen.add_argument("--output-tokens", type=positive_int, default=16, help="max_tokens of every request")
    gen.add_argument("--salt", default="", help="tag that makes prompts unique to this stream (default: s<seed>)")
    gen.add_argument("--tokenize-url", help="measure tokens per word with this server's /tokenize first")
    gen.add_argument("--model", help="model name for --tokenize-url (default: first of /v1/models)")
    gen.add_argument("--out", type=Path, help="output folder (default: work/ops/replay-generate-<UTC time>/)")
    return parser


def _gates_from_args(args: argparse.Namespace) -> list[gate_rules.Gate]:
    return gate_rules.build_gates(
        p50_s=args.gate_p50, p90_s=args.gate_p90, mean_s=args.gate_mean, success_pct=args.gate_success,
        p99_s=args.gate_p99, output_tps=args.gate_output_tps,
    )


@dataclass
class RunOutcome:
    code: int
    passed: bool
    result: dict[str, Any]  # result.json's content; empty when nothing was sent
    summary: ReplaySummary | None = None  # None when nothing was sent


def _result_setup(records: list[RequestRecord], model: str | None, started_epoch_s: float,
                  max_concurrency: int | None) -> dict[str, Any]:
    """The setup keys vllm bench serve writes before its measurements."""
    from .stream import mean_rate

    rate = mean_rate([r.offset_s for r in records])
    return {
        "date": datetime.fromtimestamp(started_epoch_s, UTC).strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai",
        "backend": "openai",
        "label": TOOL,
        "model_id": model,
        "tokenizer_id": None,
        "num_prompts": len(records),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": None,
        "max_concurrency": max_concurrency,
    }


def _judge_and_write(args: argparse.Namespace, out: Path, records: list[RequestRecord], name: str,
                     peak_observed: int | None, context: dict[str, Any],
                     started_epoch_s: float | None = None) -> RunOutcome:
    """Summary, gates, summary.json, result.json and PNGs; prints the report."""
    from . import plots
    from .replay_report import format_report, write_summary_json
    from .replay_result import build_result, write_result_json
    from .stats import summarize

    summary = summarize(records, peak_observed=peak_observed, nodes=args.nodes, goodput_slo_ms=args.goodput,
                        send_lag_warn_s=args.send_lag_warn, percentiles=args.metric_percentiles,
                        percentile_metrics=args.percentile_metrics)
    gate_results = gate_rules.evaluate(summary, _gates_from_args(args))
    passed = gate_rules.verdict(gate_results) and not context.get("aborted")
    max_concurrency = context.get("max_concurrency")
    write_summary_json(out / "summary.json", summary, gate_results, passed, context)
    setup = _result_setup(records, context.get("model"), started_epoch_s or time.time(), max_concurrency)
    result = build_result(records, summary, setup)
    result.update({"open_loop": max_concurrency is None, **context, "verdict": "PASS" if passed else "FAIL"})
    write_result_json(out / "result.json", result)
    title = f"{name}, {summary.requests} requests: {'PASS' if passed else 'FAIL'}"
    plotted = bool(summary.sent) and not args.no_plots
    if plotted:
        plots.plot_ttft_over_time(out / "ttft_over_time.png", records, summary, gate_results, title)
        plots.plot_ttft_cdf(out / "ttft_cdf.png", records, summary, gate_results, title)
        plots.plot_in_flight(out / "in_flight.png", records, summary, title)
        plots.plot_throughput(out / "throughput.png", records, summary, gate_results, title)
    print(format_report(summary, gate_results, passed, max_concurrency=max_concurrency))
    if summary.send_lag_warning:
        print(f"{TOOL}: warning: {summary.send_lag_warning}", file=sys.stderr, flush=True)
    written = ["summary.json", "result.json"] + (
        ["ttft_over_time.png", "ttft_cdf.png", "in_flight.png", "throughput.png"] if plotted else [])
    print(f"written: {out}/" + ", ".join(written))
    return RunOutcome(EXIT_OK if passed else EXIT_FAILED, passed, result, summary)


def command_report(args: argparse.Namespace) -> int:
    from .replay_report import read_records_csv

    records = read_records_csv(args.records)
    out = prepare_out_dir(args.out, "replay-report")
    outcome = _judge_and_write(args, out, records, args.records.parent.name or args.records.name, None,
                               {"records": str(args.records), "aborted": None})
    return outcome.code


def _load_requests(args: argparse.Namespace) -> tuple[list[StreamRequest], str]:
    """The requests to send and their file's format; the URL is checked first, nothing is written."""
    from .replay import base_url_problem
    from .trace_formats import read_requests

    problem = base_url_problem(args.url)
    if problem is not None:
        raise OpsError(problem)
    return read_requests(args.stream, args.format, args.trace_salt, args.default_max_tokens)


def _replay_config(args: argparse.Namespace) -> ReplayConfig:
    from .replay import ReplayConfig

    extra_body = dict(args.extra_body)
    if args.ignore_eos:
        extra_body["ignore_eos"] = True
    return ReplayConfig(
        base_url=args.url,
        model=args.model,
        request_timeout_s=args.request_timeout,
        connect_timeout_s=args.connect_timeout,
        abort_after_connect_errors=args.abort_after_connect_errors,
        abort_after_errors=args.abort_after_errors,
        max_concurrency=args.max_concurrency,
        extra_body=extra_body,
        progress_interval_s=args.progress_interval,
    )


def replay_into(args: argparse.Namespace, requests: list[StreamRequest], fmt: str, out: Path,
                rate: float | None) -> RunOutcome:
    """One replay of ``requests`` (read as ``fmt``) with its outputs in ``out``; prints the report."""
    from .replay import run_replay
    from .replay_report import write_records_csv

    span = requests[-1].offset_s
    at = f" at {rate:g} req/s" if rate is not None else ""
    limit = (f"; at most {args.max_concurrency} in flight, so NOT open loop" if args.max_concurrency else "")
    print(f"replay: {len(requests)} requests over {span:.1f} s{at} from {args.stream} ({fmt}) to "
          f"{args.url}{limit}; results in {out}", file=sys.stderr, flush=True)

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    try:
        result = asyncio.run(run_replay(requests, _replay_config(args), progress))
    except OpsError as exc:
        # nothing was sent: still leave an (empty) records file behind
        write_records_csv(out / "records.csv", [RequestRecord(id=r.id, offset_s=r.offset_s) for r in requests])
        fail(f"{exc}; nothing sent (records: {out / 'records.csv'})", EXIT_ERROR, TOOL)
        return RunOutcome(EXIT_ERROR, False, {})

    write_records_csv(out / "records.csv", result.records)
    context = {
        "stream": str(args.stream),
        "format": fmt,
        "url": args.url,
        "model": result.model,
        "started_at_utc": utc_iso(result.started_epoch_s),
        "max_concurrency": args.max_concurrency,
        "aborted": result.abort_reason,
    }
    print(f"records: {out / 'records.csv'}")
    outcome = _judge_and_write(args, out, result.records, args.stream.name, result.peak_in_flight, context,
                               result.started_epoch_s)
    if result.abort_reason is not None:
        outcome.code = EXIT_INTERRUPTED if result.interrupted else EXIT_ERROR
        sent = outcome.result["completed"] + outcome.result["failed"]
        fail(f"run stopped early: {result.abort_reason}; the {sent} requests sent are measured in "
             f"{out / 'records.csv'}", outcome.code, TOOL)
    return outcome


def command_run(args: argparse.Namespace) -> int:
    from .stream import at_rate

    requests, fmt = _load_requests(args)
    if args.request_rate is not None:
        requests = at_rate(requests, args.request_rate)
    out = prepare_out_dir(args.out, TOOL)
    return replay_into(args, requests, fmt, out, args.request_rate).code


def command_sweep(args: argparse.Namespace) -> int:
    from .replay_sweep import SweepRow, rate_folder, sweep_code, sweep_table, write_sweep
    from .stream import at_rate

    requests, fmt = _load_requests(args)
    scaled = [at_rate(requests, rate) for rate in args.rates]  # a stream that cannot be scaled fails here
    out = prepare_out_dir(args.out, SWEEP_OUT)
    rows: list[SweepRow] = []
    for rate, rate_requests in zip(args.rates, scaled):
        folder = prepare_out_dir(out / rate_folder(rate), TOOL)
        outcome = replay_into(args, rate_requests, fmt, folder, rate)
        rows.append(SweepRow(rate, folder.name, outcome.code, outcome.result,
                             outcome.summary.ttft if outcome.summary is not None else None))
        if outcome.code in (EXIT_ERROR, EXIT_INTERRUPTED):
            break
    print("\n".join(sweep_table(rows)))
    write_sweep(out, rows, {"stream": str(args.stream), "url": args.url, "rates": args.rates,
                            "max_concurrency": args.max_concurrency})
    print(f"written: {out}/sweep.json, sweep.csv")
    return sweep_code(rows, len(args.rates))


def command_generate(args: argparse.Namespace) -> int:
    from .generator import GeneratorConfig, generate, parse_histogram
    from .stats import Distribution
    from .stream import write_stream

    histogram = parse_histogram(args.length_histogram) if args.length_histogram else None
    tokens_per_word = None
    if args.tokenize_url:
        tokens_per_word = asyncio.run(_measure_ratio(args.tokenize_url, args.model))
        print(f"generate: {args.tokenize_url} counts {tokens_per_word:.4f} tokens per word", file=sys.stderr)
    config = GeneratorConfig(
        count=args.count, rate_per_s=args.rate, seed=args.seed, min_tokens=args.min_tokens,
        max_tokens=args.max_tokens, histogram=histogram, reuse_share=args.reuse_share,
        prefix_share=args.prefix_share, output_tokens=args.output_tokens, tokens_per_word=tokens_per_word,
        salt=args.salt,
    )
    config.validate()
    out = prepare_out_dir(args.out, "replay-generate")
    path = out / "stream.jsonl"
    lengths: list[float] = []
    reused = 0
    last_offset = 0.0
    with path.open("w", encoding="utf-8") as handle:
        def pairs():
            nonlocal reused, last_offset
            for i, item in enumerate(generate(config), start=1):
                lengths.append(item.approx_prompt_tokens)
                reused += item.reuses is not None
                last_offset = item.request.offset_s
                if i % 100 == 0 or i == config.count:
                    print(f"generate: {i}/{config.count} requests", file=sys.stderr, flush=True)
                yield item.request, item.extra_fields()

        write_stream(handle, pairs())
    dist = Distribution.of(lengths)
    info = {
        "stream": str(path),
        "count": config.count,
        "rate_per_s": config.rate_per_s,
        "span_s": last_offset,
        "seed": config.seed,
        "reuse_share": config.reuse_share,
        "prefix_share": config.prefix_share,
        "reused_requests": reused,
        "tokens_per_word": tokens_per_word,
        "approx_prompt_tokens": {"p50": dist.p50, "p90": dist.p90, "min": dist.min, "max": dist.max,
                                 "mean": dist.mean, "total": sum(lengths)},
    }
    (out / "generate.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}: {config.count} requests over {last_offset:.1f} s, {reused} reuse an earlier prefix, "
          f"prompt tokens p50 {dist.p50:.0f} (approx), total {sum(lengths):.0f}")
    return EXIT_OK


async def _measure_ratio(url: str, model: str | None) -> float:
    import aiohttp

    from .replay import resolve_model
    from .tokenizer_client import TokenizerClient, measure_tokens_per_word

    async with aiohttp.ClientSession() as http:
        name = await resolve_model(http, url, model, 10.0)
        return await measure_tokens_per_word(TokenizerClient(http, url, name))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"run": command_run, "sweep": command_sweep, "report": command_report, "generate": command_generate}
    return dispatch(TOOL, args, commands)
