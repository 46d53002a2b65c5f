"""``scripts/cellsim``: a fleet simulator of the KV cache tier (SimPy): pods, lockstep PCP, Valkey shards."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvsizing import geometry

from . import gates as gate_rules
from .common import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    HelpFormatter,
    OpsError,
    fail,
    fraction,
    positive_float,
    positive_int,
    prepare_out_dir,
)

TOOL = "cellsim"

DESCRIPTION = """\
Simulate prefill pods loading KV from Valkey shards, to see before deploying
whether a cache tier keeps up: requests arrive (Poisson, or a replay stream),
go to the pods round-robin; each pod's PCP group runs in lockstep; each shard
is one single-threaded server spending --get-ms per chunk GET. Synchronous
loading freezes the pod for its load; asynchronous loading delays only its
request, up to the async lookup timeout, then recomputes. Model and its
limits: scripts/README.md and scripts/opstools/cellsim_model.py.

  cellsim run ...       one configuration: TTFT, in flight, shard and GPU busy, PNGs
  cellsim sweep ...     pods x shards against TTFT gates: the smallest cell that passes
  cellsim writeup       the write-up's runaway and its fix, simulated, against its figures

example:
  scripts/cellsim run --shards 1 --loading sync --instance-gbps 0.835 --out work/ops/sim-sync
  scripts/cellsim sweep --rate 4.8 --pods 1,2,4 --shards 1,2,4,8 --loading async --gate-p90 2
  scripts/cellsim writeup --seeds 20
"""


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1, got {text!r}")
    return values


def _add_cell_options(parser: argparse.ArgumentParser, sweep: bool) -> None:
    cell = parser.add_argument_group("cell")
    if sweep:
        cell.add_argument("--pods", type=int_list, default=[1, 2, 4], metavar="P,P", help="prefill pods to try")
        cell.add_argument("--shards", type=int_list, default=[1, 2, 4, 8], metavar="N,N",
                          help="Valkey instances to try")
    else:
        cell.add_argument("--pods", type=positive_int, default=1, help="prefill pods (round-robin routing)")
        cell.add_argument("--shards", type=positive_int, default=1, help="Valkey instances")
    cell.add_argument("--ranks", type=positive_int, default=8, help="PCP ranks per pod, in lockstep")
    cell.add_argument("--store", choices=("sharded", "rank0"), default="sharded",
                      help="sharded: rank r reads chunks c mod ranks = r from shard r mod shards; "
                           "rank0: rank 0 reads every chunk from shard 0")
    cell.add_argument("--loading", choices=("sync", "async"), default="sync")
    cell.add_argument("--async-timeout", type=positive_float, default=3.0, metavar="S",
                      help="LMCache's async lookup timeout: recompute after S seconds")
    speed = cell.add_mutually_exclusive_group()
    speed.add_argument("--get-ms", type=positive_float, metavar="MS",
                       help="server time per chunk GET (valkey-stats' usec per GET / 1000) of the chunks it was "
                            "measured with (write-up H5b: 8.9 per 12.4 MB GET)")
    speed.add_argument("--instance-gbps", type=positive_float, default=0.835, metavar="GB_S",
                       help="one instance's bandwidth; a GET costs chunk-mb / this, the server's time scaled by "
                            "bytes (write-up: 0.78-0.89, measured with its 12.4 MB chunks)")
    chunk = cell.add_mutually_exclusive_group()
    chunk.add_argument("--chunk-mb", type=positive_float, default=argparse.SUPPRESS,
                       help="MB per chunk (default: from --model-config; the write-up's runs: 12.4)")
    chunk.add_argument("--model-config", type=Path, metavar="CONFIG_JSON", default=argparse.SUPPRESS,
                       help="the chunk from a model's config.json by vLLM's rule (default GLM-5.3's: "
                            f"{geometry.GLM53.describe()} x 256 = {geometry.CHUNK_BYTES / 1e6:.3f} MB with the "
                            "presets' fp8)")
    cell.add_argument("--kv-cache-dtype", choices=geometry.CACHE_DTYPES, default="fp8",
                      help="for --model-config: fp8 (the presets; default) or fp8_ds_mla (FLASHMLA_SPARSE)")
    cell.add_argument("--chunk-tokens", type=positive_int, default=256)
    cell.add_argument("--recompute-s", type=positive_float, default=0.31, metavar="S",
                      help="seconds to prefill --recompute-tokens from scratch (write-up: 0.31 s for 16k)")
    cell.add_argument("--recompute-tokens", type=positive_int, default=16_384)
    load = parser.add_argument_group("load")
    load.add_argument("--stream", type=Path, help="a replay stream (JSONL) for the arrivals instead of Poisson; "
                                                   "prompt length from prompt_token_ids, else approx_prompt_tokens, "
                                                   "else --prompt-tokens")
    load.add_argument("--count", type=positive_int, default=450, help="Poisson: requests")
    load.add_argument("--rate", type=positive_float, default=450 / 374, help="Poisson: requests per second")
    load.add_argument("--prompt-tokens", type=positive_int, default=16_384)
    load.add_argument("--hit-fraction", type=fraction, default=0.985,
                      help="share of each prompt in L2 (whole chunks; write-up: 98.5%%)")
    load.add_argument("--miss-share", type=fraction, default=0.0, help="share of requests that find nothing")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--seeds", type=positive_int, default=1, help="repeat over this many Poisson streams")


def chunk_mb(args: argparse.Namespace) -> float:
    """--chunk-mb, or the chunk of --chunk-tokens tokens of the model's KV (GLM-5.3's by default)."""
    if getattr(args, "chunk_mb", None) is not None:
        return args.chunk_mb
    path = getattr(args, "model_config", None)
    try:
        config = geometry.GLM53_CONFIG if path is None else geometry.load_config(path)
        kv = geometry.from_config(config, args.kv_cache_dtype)
    except geometry.ConfigError as exc:
        raise OpsError(f"--model-config: {exc}") from None
    return kv.chunk_bytes(args.chunk_tokens) / 1e6


def _config(args: argparse.Namespace, pods: int, shards: int):
    from .cellsim_model import CellConfig

    get_s = args.get_ms / 1000.0 if args.get_ms else chunk_mb(args) * 1e6 / (args.instance_gbps * 1e9)
    config = CellConfig(pods=pods, ranks=args.ranks, shards=shards, store=args.store, loading=args.loading,
                        get_s=get_s, chunk_tokens=args.chunk_tokens,
                        prefill_tokens_per_s=args.recompute_tokens / args.recompute_s,
                        async_timeout_s=args.async_timeout)
    try:
        config.validate()
    except ValueError as exc:
        raise OpsError(str(exc)) from None
    return config


def _arrivals(args: argparse.Namespace, seed: int):
    import math

    from .cellsim_model import Arrival, poisson_arrivals

    if args.stream is None:
        return poisson_arrivals(args.count, args.rate, args.prompt_tokens, args.hit_fraction, args.chunk_tokens,
                                seed, args.miss_share)
    from .stream import read_stream

    requests = read_stream(args.stream)
    lengths: dict[str, int] = {}
    with args.stream.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                obj = json.loads(line)
                if isinstance(obj.get("approx_prompt_tokens"), (int, float)):
                    lengths[str(obj.get("id", ""))] = int(obj["approx_prompt_tokens"])
    arrivals = []
    for request in requests:
        tokens = len(request.prompt_token_ids) if request.prompt_token_ids else lengths.get(request.id,
                                                                                           args.prompt_tokens)
        hit = math.floor(tokens * args.hit_fraction / args.chunk_tokens) * args.chunk_tokens
        arrivals.append(Arrival(request.offset_s, tokens, hit))
    return arrivals


def _records(result) -> list:
    from .records import OK, RequestRecord

    records = []
    for index, outcome in enumerate(result.outcomes):
        arrival = outcome.arrival
        records.append(RequestRecord(
            id=f"r{index:05d}", offset_s=arrival.arrival_s, sent_s=arrival.arrival_s,
            first_token_s=outcome.first_token_s, end_s=outcome.first_token_s, prompt_tokens=arrival.prompt_tokens,
            completion_tokens=1, cached_tokens=0 if outcome.timed_out else arrival.hit_tokens, status=OK,
            error="async lookup timeout: recomputed" if outcome.timed_out else "",
        ))
    return records


def _sim_figures(result) -> dict[str, Any]:
    return {
        "gpu_busy": result.gpu_busy_fraction(),
        "shard_utilisation": result.shard_utilisation(),
        "timeout_share": result.timeout_share(),
        "makespan_s": result.makespan_s,
        "get_ms": result.config.get_s * 1000,
    }


def _gates(args: argparse.Namespace) -> list[gate_rules.Gate]:
    return gate_rules.build_gates(p50_s=args.gate_p50, p90_s=args.gate_p90, mean_s=args.gate_mean,
                                  success_pct=None, p99_s=args.gate_p99)


def _add_gates(parser: argparse.ArgumentParser) -> None:
    from .replay_cli import gate_limit

    parser.add_argument("--gate-p90", type=gate_limit, default=gate_rules.DEFAULT_P90_S, metavar="S")
    parser.add_argument("--gate-p50", type=gate_limit, default=gate_rules.DEFAULT_P50_S, metavar="S")
    parser.add_argument("--gate-mean", type=gate_limit, default=gate_rules.DEFAULT_MEAN_S, metavar="S")
    parser.add_argument("--gate-p99", type=gate_limit, default=None, metavar="S")


def command_run(args: argparse.Namespace) -> int:
    from .cellsim_model import simulate
    from .replay_report import format_report, write_records_csv
    from .stats import summarize

    config = _config(args, args.pods, args.shards)
    out = prepare_out_dir(args.out, TOOL)
    runs = []
    for seed in range(args.seed, args.seed + args.seeds):
        result = simulate(config, _arrivals(args, seed))
        records = _records(result)
        summary = summarize(records)
        results = gate_rules.evaluate(summary, _gates(args))
        runs.append((seed, result, records, summary, results))
    seed, result, records, summary, results = runs[0]
    write_records_csv(out / "records.csv", records)
    passed = gate_rules.verdict(results)
    print(f"cell: {config.pods} pod(s) x {config.ranks} ranks, {config.shards} shard(s), {config.store} store, "
          f"{config.loading} loading, {config.get_s * 1000:.2f} ms per GET, recompute "
          f"{args.recompute_tokens / config.prefill_tokens_per_s:.3f} s per {args.recompute_tokens} tokens")
    print(format_report(summary, results, passed).split("\nthroughput")[0])
    util = result.shard_utilisation()
    print(f"shard utilisation: {', '.join(f'{u:.1%}' for u in util)}; GPU busy {result.gpu_busy_fraction():.1%}; "
          f"async timeouts {result.timeout_share():.1%} of requests")
    data: dict[str, Any] = {
        "config": config.__dict__, "seed": seed, "summary": summary.to_json(), "sim": _sim_figures(result),
        "verdict": "PASS" if passed else "FAIL",
    }
    if args.seeds > 1:
        import statistics

        p90 = [s.ttft.p90 for _, _, _, s, _ in runs]
        share = sum(gate_rules.verdict(r) for *_, r in runs) / len(runs)
        print(f"over {args.seeds} streams: TTFT p90 median {statistics.median(p90):.2f} s "
              f"(range {min(p90):.2f}-{max(p90):.2f}); gates pass in {share:.0%} of them")
        data["seeds"] = [{"seed": sd, "ttft_p90": s.ttft.p90, "ttft_p50": s.ttft.p50, "peak_in_flight":
                          s.peak_in_flight, "passed": gate_rules.verdict(r)} for sd, _, _, s, r in runs]
        passed = share == 1.0
    (out / "summary.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if not args.no_plots:
        from . import plots
        from .cellsim_plots import plot_cache_tier

        title = f"simulated, {config.pods}P x {config.shards} shards, {config.loading}"
        plots.plot_ttft_over_time(out / "ttft_over_time.png", records, summary, results, title)
        plots.plot_in_flight(out / "in_flight.png", records, summary, title)
        plot_cache_tier(out / "cache_tier.png", result, title)
    print(f"written: {out}/records.csv (replay format), summary.json"
          + ("" if args.no_plots else ", ttft_over_time.png, in_flight.png, cache_tier.png"))
    print(f"verdict: {'PASS' if passed else 'FAIL'}")
    return EXIT_OK if passed else EXIT_FAILED


def command_sweep(args: argparse.Namespace) -> int:
    import statistics

    from .cellsim_model import simulate
    from .stats import summarize

    rows = []
    print(f"| pods | shards | TTFT p50 | TTFT p90 | TTFT mean | max shard util | GPU busy | timeouts | "
          f"gates pass ({args.seeds} streams) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for pods in args.pods:
        for shards in args.shards:
            config = _config(args, pods, shards)
            seeds = []
            for seed in range(args.seed, args.seed + args.seeds):
                result = simulate(config, _arrivals(args, seed))
                summary = summarize(_records(result))
                seeds.append((summary, result, gate_rules.verdict(gate_rules.evaluate(summary, _gates(args)))))
            med = statistics.median
            row = {
                "pods": pods, "shards": shards,
                "ttft_p50": med(s.ttft.p50 for s, _, _ in seeds), "ttft_p90": med(s.ttft.p90 for s, _, _ in seeds),
                "ttft_mean": med(s.ttft.mean for s, _, _ in seeds),
                "shard_util": med(max(r.shard_utilisation()) for _, r, _ in seeds),
                "gpu_busy": med(r.gpu_busy_fraction() for _, r, _ in seeds),
                "timeouts": med(r.timeout_share() for _, r, _ in seeds),
                "pass_share": sum(p for *_, p in seeds) / len(seeds),
            }
            rows.append(row)
            print(f"| {pods} | {shards} | {row['ttft_p50']:.2f} s | {row['ttft_p90']:.2f} s | {row['ttft_mean']:.2f} s "
                  f"| {row['shard_util']:.1%} | {row['gpu_busy']:.1%} | {row['timeouts']:.1%} | "
                  f"{row['pass_share']:.0%} |")
    passing = [r for r in rows if r["pass_share"] == 1.0]
    best = min(passing, key=lambda r: (r["pods"], r["shards"])) if passing else None
    gates = ", ".join(g.description for g in _gates(args))
    if best is None:
        print(f"no cell of these passes {gates} in every stream")
    else:
        print(f"smallest cell passing {gates} in every stream: {best['pods']} pod(s), {best['shards']} shard(s)")
    if args.out is not None:
        out = prepare_out_dir(args.out, TOOL)
        (out / "sweep.json").write_text(json.dumps({"rows": rows, "gates": gates}, indent=2) + "\n")
    return EXIT_OK if best is not None else EXIT_FAILED


def command_writeup(args: argparse.Namespace) -> int:
    from .cellsim_writeup import format_table, reproduce

    rows = reproduce(seeds=args.seeds, first_seed=args.seed)
    print(format_table(rows, args.seeds))
    if args.out is not None:
        out = prepare_out_dir(args.out, TOOL)
        (out / "writeup.json").write_text(json.dumps([
            {"scenario": r.figure.scenario, "figure": r.figure.name, "writeup": r.figure.writeup,
             "claim": r.figure.claim, "median": r.median, "seed_range": [r.seed_low, r.seed_high],
             "bandwidth_range": [r.band_low, r.band_high], "within_20pct": r.within_20pct}
            for r in rows], indent=2) + "\n")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=TOOL, description=DESCRIPTION, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,sweep,writeup}")
    run = sub.add_parser("run", help="simulate one cell", formatter_class=HelpFormatter)
    _add_cell_options(run, sweep=False)
    _add_gates(run)
    run.add_argument("--no-plots", action="store_true")
    run.add_argument("--out", type=Path, help="output folder (default: work/ops/cellsim-<UTC time>/)")
    sweep = sub.add_parser("sweep", help="pods x shards against TTFT gates", formatter_class=HelpFormatter)
    _add_cell_options(sweep, sweep=True)
    _add_gates(sweep)
    sweep.add_argument("--out", type=Path, help="also write sweep.json here")
    writeup = sub.add_parser("writeup", help="the write-up's figures, simulated", formatter_class=HelpFormatter)
    writeup.add_argument("--seeds", type=positive_int, default=20)
    writeup.add_argument("--seed", type=int, default=0)
    writeup.add_argument("--out", type=Path, help="also write writeup.json here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return command_run(args)
        if args.command == "sweep":
            return command_sweep(args)
        return command_writeup(args)
    except OpsError as exc:
        return fail(str(exc), EXIT_ERROR, TOOL)
    except KeyboardInterrupt:
        return fail("interrupted", EXIT_INTERRUPTED, TOOL)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
