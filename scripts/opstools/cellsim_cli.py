"""``scripts/cellsim``: a fleet simulator of the KV cache tier (SimPy): pods, lockstep PCP, Valkey shards."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvsizing import geometry

from . import cellsim_defaults as defaults
from . import gates as gate_rules
from .cellsim_config import LOAD_PATHS
from .common import (
    EXIT_FAILED,
    EXIT_OK,
    HelpFormatter,
    OpsError,
    dispatch,
    fraction,
    positive_float,
    positive_int,
    prepare_out_dir,
)

TOOL = "cellsim"

DESCRIPTION = """\
Simulate prefill pods loading KV from Valkey shards, to see before deploying
whether a cache tier keeps up: requests arrive (Poisson, or a trace with its
send times), go to the pods round-robin; each pod's PCP group runs in
lockstep and batches waiting requests into steps; each shard is one main
thread shared by the GETs of every client in flight. Synchronous loading
freezes the pod for its loads; asynchronous loading prefetches, up to the
async lookup timeout, then recomputes while the prefetch runs on. Every
default comes from a measurement of the write-up (scripts/README.md, and
scripts/opstools/cellsim_defaults.py says which).

  cellsim run ...       one configuration over --seeds streams: TTFT, in flight, shard and GPU busy, PNGs
  cellsim sweep ...     pods x shards against TTFT gates: the smallest cell that passes
  cellsim writeup       the write-up's runaway and its fix, simulated, against its figures

example:
  scripts/cellsim run --shards 1 --loading sync --seeds 20 --out work/ops/sim-sync
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


def shard_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated instance numbers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected instance numbers >= 0, got {text!r}")
    return values


def token_span(text: str) -> int | tuple[int, int]:
    """``16384`` or ``9000-200000`` (log-uniform between the two)."""
    parts = text.split("-")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKENS or MIN-MAX, got {text!r}") from None
    if len(values) not in (1, 2) or any(v < 1 for v in values) or values != sorted(values):
        raise argparse.ArgumentTypeError(f"expected TOKENS or MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return values[0] if len(values) == 1 else (values[0], values[1])


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _add_valkey_options(cell: argparse._ArgumentGroup) -> None:
    speed = cell.add_mutually_exclusive_group()
    speed.add_argument("--get-ms", type=positive_float, default=defaults.GET_MS, metavar="MS",
                       help="server time per chunk GET with one client reading the instance (valkey-stats' usec per "
                            "GET / 1000), measured with --measured-chunk-mb chunks (write-up H5b: 8.9)")
    speed.add_argument("--get-gbps", type=positive_float, metavar="GB_S",
                       help="the same as a bandwidth: bytes per second of GETs with one client in flight")
    cell.add_argument("--measured-chunk-mb", type=positive_float, default=geometry.WRITEUP_CHUNK_BYTES / 1e6,
                      metavar="MB", help="the chunk --get-ms was measured with; applied to this run's chunk the "
                                         "time is scaled by bytes (write-up: 12.4)")
    cell.add_argument("--get-contention", type=non_negative_float, default=defaults.GET_CONTENTION, metavar="X",
                      help="how much longer a GET takes per further client in flight at the instance (write-up: "
                           "one instance loaded a 16k prompt for eight ranks in 0.83-0.89 s)")


def _add_engine_options(cell: argparse._ArgumentGroup) -> None:
    cell.add_argument("--engine-load-ms", type=non_negative_float, default=defaults.ENGINE_LOAD_S_PER_CHUNK * 1000,
                      metavar="MS", help="the engine's own time per loaded chunk (write-up: the 8-shard median "
                                         "hit ~0.1 s over recompute)")
    cell.add_argument("--step-copy-ms", type=non_negative_float, default=defaults.STEP_COPY_S_PER_CHUNK * 1000,
                      metavar="MS", help="of the engine's time per loaded chunk, the copy into GPU memory that only "
                                         "the step can do, async loading too (write-up: rank 0's 19.1 GB of in-step "
                                         "copies kept the other ranks waiting 1.55 s)")
    cell.add_argument("--async-load-path", choices=LOAD_PATHS, default=defaults.ASYNC_LOAD_PATH,
                      help="async loading: where the rest of the engine's time per loaded chunk is spent, in the "
                           "request's background prefetch (default), in the pod's one background loader "
                           "(prefetches in turn, outside the step), or in the step (holding the pod)")
    cell.add_argument("--gpu-load-ms", type=non_negative_float, default=defaults.GPU_LOAD_S_PER_CHUNK * 1000,
                      metavar="MS", help="GPU work per loaded chunk, inside the step (the per-chunk broadcast; "
                                         "write-up: GPUs 7%% busy in the sync runaway)")
    cell.add_argument("--gpu-step-ms", type=non_negative_float, default=defaults.GPU_STEP_S * 1000, metavar="MS",
                      help="GPU work per step besides computing its tokens and its loaded chunks' (default 0)")
    cell.add_argument("--step-tokens", type=positive_int, default=defaults.STEP_TOKENS,
                      help="tokens computed per step at most (the preset's max-num-batched-tokens)")
    cell.add_argument("--step-requests", type=positive_int, default=defaults.STEP_REQUESTS,
                      help="requests per step at most (vLLM's max_num_seqs); 1: no batching")
    cell.add_argument("--recompute-s", type=positive_float, default=defaults.RECOMPUTE_S, metavar="S",
                      help="seconds to prefill --recompute-tokens from scratch (write-up: 0.31 s for 16k)")
    cell.add_argument("--recompute-tokens", type=positive_int, default=defaults.RECOMPUTE_TOKENS)
    cell.add_argument("--async-timeout", type=positive_float, default=defaults.ASYNC_TIMEOUT_S, metavar="S",
                      help="LMCache's async lookup timeout: recompute after S seconds")
    cell.add_argument("--orphan-cap", type=int, default=None, metavar="N",
                      help="timed-out prefetches that keep running per pod; the prefetch of a request that times "
                           "out beyond N is cancelled (default: no cap, as the write-up saw them keep running)")


def _add_cell_options(parser: argparse.ArgumentParser, sweep: bool) -> None:
    cell = parser.add_argument_group("cell")
    if sweep:
        cell.add_argument("--pods", type=int_list, default=[1, 2, 4], metavar="P,P", help="prefill pods to try")
        cell.add_argument("--shards", type=int_list, default=[1, 2, 4, 8], metavar="N,N",
                          help="Valkey instances to try")
    else:
        cell.add_argument("--pods", type=positive_int, default=1, help="prefill pods (round-robin routing)")
        cell.add_argument("--shards", type=positive_int, default=1, help="Valkey instances")
    cell.add_argument("--lost-shards", type=shard_list, default=(), metavar="I,I",
                      help="instances that are down (numbered from 0): a prompt's hit ends at its first chunk there")
    cell.add_argument("--ranks", type=positive_int, default=defaults.RANKS, help="PCP ranks per pod, in lockstep")
    cell.add_argument("--store", choices=("sharded", "rank0"), default="sharded",
                      help="sharded: rank r reads chunks c mod ranks = r from shard r mod shards; "
                           "rank0: rank 0 reads every chunk from shard 0")
    cell.add_argument("--loading", choices=("sync", "async"), default="sync")
    _add_valkey_options(cell)
    _add_engine_options(cell)
    chunk = cell.add_mutually_exclusive_group()
    chunk.add_argument("--chunk-mb", type=positive_float, default=argparse.SUPPRESS,
                       help="MB per chunk (default: from --model-config; the write-up's runs: 12.4)")
    chunk.add_argument("--model-config", type=Path, metavar="CONFIG_JSON", default=argparse.SUPPRESS,
                       help="the chunk from a model's config.json by vLLM's rule (default GLM-5.3's: "
                            f"{geometry.GLM53.describe()} x 256 = {geometry.CHUNK_BYTES / 1e6:.3f} MB with the "
                            "presets' fp8)")
    cell.add_argument("--kv-cache-dtype", choices=geometry.CACHE_DTYPES, default="fp8",
                      help="for --model-config: fp8 (the presets; default) or fp8_ds_mla (FLASHMLA_SPARSE)")
    cell.add_argument("--chunk-tokens", type=positive_int, default=defaults.CHUNK_TOKENS)
    load = parser.add_argument_group("load")
    load.add_argument("--trace", "--stream", dest="trace", type=Path,
                      help="a JSONL trace with each request's send time (offset_s) and length: the replay stream's "
                           "format, or just offset_s, prompt_tokens and optionally hit_tokens (cellsim_arrivals.py)")
    load.add_argument("--count", type=positive_int, default=450, help="Poisson: requests")
    load.add_argument("--rate", type=positive_float, default=450 / 374, help="Poisson: requests per second")
    load.add_argument("--prompt-tokens", type=token_span, default=16_384, metavar="TOKENS|MIN-MAX",
                      help="Poisson: the prompt length, or a range drawn log-uniform; a trace line without a length")
    load.add_argument("--hit-fraction", type=fraction, default=0.985,
                      help="share of each prompt in L2 (whole chunks; write-up: 98.5%%)")
    load.add_argument("--miss-share", type=fraction, default=0.0, help="Poisson: share of requests that find nothing")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--seeds", type=positive_int, default=1, help="repeat over this many Poisson streams")


def chunk_bytes(args: argparse.Namespace) -> float:
    """--chunk-mb, or the chunk of --chunk-tokens tokens of the model's KV (GLM-5.3's by default)."""
    if getattr(args, "chunk_mb", None) is not None:
        return args.chunk_mb * 1e6
    path = getattr(args, "model_config", None)
    try:
        config = geometry.GLM53_CONFIG if path is None else geometry.load_config(path)
        kv = geometry.from_config(config, args.kv_cache_dtype)
    except geometry.ConfigError as exc:
        raise OpsError(f"--model-config: {exc}") from None
    return float(kv.chunk_bytes(args.chunk_tokens))


def get_s(args: argparse.Namespace) -> float:
    if args.get_gbps is not None:
        return defaults.get_s_from_gbps(args.get_gbps, chunk_bytes(args))
    return defaults.get_s_for_chunk(args.get_ms, args.measured_chunk_mb * 1e6, chunk_bytes(args))


def cell_config(args: argparse.Namespace, pods: int, shards: int):
    from .cellsim_config import CellConfig

    config = CellConfig(
        pods=pods, ranks=args.ranks, shards=shards, store=args.store, loading=args.loading, get_s=get_s(args),
        get_contention=args.get_contention, engine_load_s_per_chunk=args.engine_load_ms / 1000,
        step_copy_s_per_chunk=args.step_copy_ms / 1000,
        gpu_step_s=args.gpu_step_ms / 1000, gpu_load_s_per_chunk=args.gpu_load_ms / 1000,
        async_load_path=args.async_load_path, step_tokens=args.step_tokens, step_requests=args.step_requests,
        chunk_tokens=args.chunk_tokens, prefill_tokens_per_s=args.recompute_tokens / args.recompute_s,
        async_timeout_s=args.async_timeout, orphan_cap=args.orphan_cap, lost_shards=tuple(args.lost_shards))
    try:
        config.validate()
    except ValueError as exc:
        raise OpsError(str(exc)) from None
    return config


def arrivals_source(args: argparse.Namespace):
    """seed -> arrivals: a Poisson stream per seed, or the trace (read once, the same for every seed)."""
    from .cellsim_arrivals import poisson_arrivals, read_trace

    if args.trace is not None:
        default_tokens = args.prompt_tokens if isinstance(args.prompt_tokens, int) else args.prompt_tokens[0]
        trace = read_trace(args.trace, default_tokens, args.hit_fraction, args.chunk_tokens)
        return lambda seed: trace
    return lambda seed: poisson_arrivals(args.count, args.rate, args.prompt_tokens, args.hit_fraction,
                                         args.chunk_tokens, seed, args.miss_share)


def _gates(args: argparse.Namespace) -> list[gate_rules.Gate]:
    return gate_rules.build_gates(p50_s=args.gate_p50, p90_s=args.gate_p90, mean_s=args.gate_mean,
                                  success_pct=None, p99_s=args.gate_p99)


def _add_gates(parser: argparse.ArgumentParser) -> None:
    from .replay_cli import gate_limit

    parser.add_argument("--gate-p90", type=gate_limit, default=gate_rules.DEFAULT_P90_S, metavar="S")
    parser.add_argument("--gate-p50", type=gate_limit, default=gate_rules.DEFAULT_P50_S, metavar="S")
    parser.add_argument("--gate-mean", type=gate_limit, default=gate_rules.DEFAULT_MEAN_S, metavar="S")
    parser.add_argument("--gate-p99", type=gate_limit, default=None, metavar="S")


def _seeds(args: argparse.Namespace) -> range:
    # a trace is one stream: more seeds would repeat the same run
    return range(args.seed, args.seed + (1 if args.trace is not None else args.seeds))


def describe(config, args: argparse.Namespace) -> str:
    lost = f", shard(s) {','.join(map(str, config.lost_shards))} down" if config.lost_shards else ""
    return (f"cell: {config.pods} pod(s) x {config.ranks} ranks, {config.shards} shard(s){lost}, {config.store} "
            f"store, {config.loading} loading, {config.get_s * 1000:.2f} ms per GET (+{config.get_contention:.1%} "
            f"per further client), engine {config.engine_load_s_per_chunk * 1000:.2f} ms per loaded chunk "
            f"(async: {config.in_step_s_per_chunk() * 1000:.2f} ms in the step, the rest in the "
            f"{config.async_load_path}), GPU {config.gpu_load_s_per_chunk * 1000:.2f} ms per loaded "
            f"chunk and {config.gpu_step_s * 1000:.0f} ms per step, recompute "
            f"{args.recompute_tokens / config.prefill_tokens_per_s:.3f} s per {args.recompute_tokens} tokens")


def command_run(args: argparse.Namespace) -> int:
    from . import cellsim_runs as runs_of

    config = cell_config(args, args.pods, args.shards)
    runs = runs_of.run_seeds(config, arrivals_source(args), _seeds(args), _gates(args))
    out = prepare_out_dir(args.out, TOOL)
    passed = runs_of.verdict(runs)
    print(describe(config, args))
    print(runs_of.format_table(runs))
    print(runs_of.format_gates(runs))
    summary = runs_of.summary_json(config, runs)
    runs_of.write_records(out / "records.csv", runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    written = f"{out}/records.csv (replay format, a seed column), summary.json"
    if not args.no_plots:
        from . import plots
        from .cellsim_plots import plot_cache_tier

        first = runs[0]
        title = (f"simulated, {config.pods}P x {config.shards} shards, {config.loading}, seed {first.seed}"
                 + (f" (first of {len(runs)})" if len(runs) > 1 else ""))
        results = first.gates
        plots.plot_ttft_over_time(out / "ttft_over_time.png", first.records, first.summary, results, title)
        plots.plot_in_flight(out / "in_flight.png", first.records, first.summary, title)
        plot_cache_tier(out / "cache_tier.png", first.result, title)
        written += f"; ttft_over_time.png, in_flight.png, cache_tier.png of seed {first.seed}"
    print(f"written: {written}")
    print(f"verdict over {runs_of.seeds_label(runs)}: {'PASS' if passed else 'FAIL'}")
    return EXIT_OK if passed else EXIT_FAILED


def command_sweep(args: argparse.Namespace) -> int:
    from . import cellsim_runs as runs_of

    source = arrivals_source(args)
    seeds = _seeds(args)
    rows = []
    print(f"| pods | shards | TTFT p50 | TTFT p90 | TTFT mean | tokens/min | busiest shard | GPU busy | timeouts | "
          f"gates pass (seeds of {len(seeds)}) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for pods in args.pods:
        for shards in args.shards:
            runs = runs_of.run_seeds(cell_config(args, pods, shards), source, seeds, _gates(args))
            med = {key: value["median"] for key, value in runs_of.aggregate(runs).items()}
            row = {"pods": pods, "shards": shards, **med, "passed_seeds": sum(r.passed for r in runs),
                   "seeds": len(runs)}
            rows.append(row)
            print(f"| {pods} | {shards} | {med['ttft_p50']:.2f} s | {med['ttft_p90']:.2f} s | "
                  f"{med['ttft_mean']:.2f} s | {med['tokens_per_minute'] / 1e6:.2f}M | "
                  f"{med['max_shard_utilisation']:.1%} | {med['gpu_busy']:.1%} | {med['timeout_share']:.1%} | "
                  f"{row['passed_seeds']} |")
    passing = [r for r in rows if r["passed_seeds"] == r["seeds"]]
    best = min(passing, key=lambda r: (r["pods"], r["shards"])) if passing else None
    gates = ", ".join(g.description for g in _gates(args))
    if best is None:
        print(f"no cell of these passes {gates} in every seed")
    else:
        print(f"smallest cell passing {gates} in every seed: {best['pods']} pod(s), {best['shards']} shard(s)")
    if args.out is not None:
        out = prepare_out_dir(args.out, TOOL)
        (out / "sweep.json").write_text(json.dumps({"rows": rows, "gates": gates}, indent=2) + "\n")
    return EXIT_OK if best is not None else EXIT_FAILED


def command_writeup(args: argparse.Namespace) -> int:
    from .cellsim_writeup import MEASURED, PREDICTIONS, format_tables, reproduce

    measured, predicted = reproduce(seeds=args.seeds, first_seed=args.seed)
    print(format_tables(measured, predicted, args.seeds))
    if args.out is not None:
        out = prepare_out_dir(args.out, TOOL)
        rows = [{"scenario": f.scenario, "figure": f.name, "writeup": [f.low, f.high], "claim": f.claim,
                 "median": r.median, "seed_range": [r.seed_low, r.seed_high], "load_band": r.band,
                 "within_20pct": f.within(r.median), "sets_default": f.calibrates, "missing": f.missing}
                for f, r in zip(MEASURED, measured, strict=True)]
        rows += [{"scenario": p.scenario, "prediction": p.claim, "writeup": p.value, "median": r.median}
                 for p, r in zip(PREDICTIONS, predicted, strict=True)]
        (out / "writeup.json").write_text(json.dumps({"seeds": args.seeds, "rows": rows}, indent=2) + "\n")
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
    return dispatch(TOOL, args, {"run": command_run, "sweep": command_sweep, "writeup": command_writeup})


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
