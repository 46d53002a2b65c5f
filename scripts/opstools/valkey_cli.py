"""``scripts/valkey-stats``: GET rate, time per GET, main-thread CPU, network bytes and latency of every shard."""
from __future__ import annotations

import argparse
import csv
import json
import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from types import FrameType

from .common import (
    EXIT_FAILED,
    EXIT_OK,
    HelpFormatter,
    fail,
    positive_float,
    positive_int,
    prepare_out_dir,
    run_guarded,
    utc_iso,
)
from .valkey_sampler import COMMANDS, PERCENTILES

TOOL = "valkey-stats"

DESCRIPTION = """\
Every --interval seconds, read INFO commandstats, cpu, stats, memory, clients,
latencystats and errorstats from every Valkey shard and report per interval and
shard: for GET, SET, EXISTS and MGET the calls/s, server microseconds per call,
share of the main thread's time spent in them, rejected calls and the server's
p50/p99/p99.9 latency (lifetime percentiles, as Valkey keeps them); the total
main-thread busy share and main-thread CPU (% of one core); network bytes/s in
and out (deltas of total_net_input_bytes / total_net_output_bytes); evicted keys,
keyspace hits and misses, error replies by type, connected clients and used
memory. The bytes/s each shard served is the cost model's b (kv-sizing
--instance-gbps), measured under the load the shard had. Stops after --duration,
or cleanly on Ctrl-C (SIGINT) or SIGTERM; outputs are written either way.

examples:
  scripts/valkey-stats --url-template 'resp://valkey-lmcache-{rank}.vllm.svc.cluster.local:6379' \\
      --shards 8 --interval 5 --duration 600 --out work/ops/valkey-hh
  scripts/valkey-stats --url resp://127.0.0.1:6379 --url resp://127.0.0.1:6380 --interval 1
"""

EPILOG = """\
outputs in --out: intervals.csv (one row per shard and interval), summary.json,
valkey_stats.png (per command calls/s and time per call, busy and CPU, evictions and
misses, used memory, network bytes/s in and out). URLs: resp://, redis://, valkey://
(rediss:// for TLS), user:password@ and /db allowed. Exit: 0 done, 1 some samples
failed, 2 error (a shard does not answer at the start, bad URL).
"""


def _percentile_column(percentile: str) -> str:
    """p99.9 -> p99_9 (a column name without a dot)."""
    return percentile.replace(".", "_")


CSV_COLUMNS = (
    "shard", "url", "start_s", "end_s", "end_at_utc", "interval_s",
    *(f"{cmd}_{what}" for cmd in COMMANDS
      for what in ("calls", "calls_per_s", "usec_per_call", "busy_pct")),
    *(f"{cmd}_rejected_calls" for cmd in COMMANDS),
    *(f"{cmd}_{_percentile_column(p)}_usec" for cmd in COMMANDS for p in PERCENTILES),
    "total_busy_pct", "main_cpu_pct", "cpu_source", "other_calls_per_s",
    "evicted_keys", "evicted_keys_per_s", "keyspace_hits", "keyspace_misses", "keyspace_misses_per_s",
    "used_memory_bytes", "maxmemory_bytes",
    "net_input_bytes", "net_output_bytes", "net_in_bytes_per_s", "net_out_bytes_per_s",
    "rejected_calls", "failed_calls", "error_replies", "errors", "connected_clients", "rejected_connections",
    "error",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=TOOL, description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    parser.add_argument("--url-template", metavar="URL", help="shard URL with {rank}, e.g. resp://valkey-{rank}:6379")
    parser.add_argument("--shards", type=positive_int, metavar="N", help="number of shards for --url-template")
    parser.add_argument("--url", action="append", default=[], metavar="URL",
                        help="a shard URL (repeat, or comma-separate, for more shards)")
    parser.add_argument("--interval", type=positive_float, default=5.0, metavar="S", help="seconds between samples")
    parser.add_argument("--duration", type=positive_float, metavar="S", help="stop after S seconds (default: Ctrl-C)")
    parser.add_argument("--timeout", type=positive_float, default=3.0, metavar="S", help="per-shard INFO timeout")
    parser.add_argument("--out", type=Path, help="output folder (default: work/ops/valkey-stats-<UTC time>/)")
    parser.add_argument("--quiet", action="store_true", help="no per-interval lines")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG")
    return parser


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def interval_row(row) -> dict[str, str]:
    values: dict[str, object] = {
        "shard": row.shard, "url": row.url, "start_s": row.start_s, "end_s": row.end_s,
        "end_at_utc": utc_iso(row.end_epoch_s), "interval_s": row.interval_s, "error": row.error,
    }
    if not row.error:
        for name in COMMANDS:
            stats = row.command(name)
            values.update({f"{name}_calls": stats.calls, f"{name}_calls_per_s": stats.calls_per_s,
                           f"{name}_usec_per_call": stats.usec_per_call, f"{name}_busy_pct": stats.busy_pct,
                           f"{name}_rejected_calls": stats.rejected_calls})
            values.update({f"{name}_{_percentile_column(p)}_usec": stats.latency_usec.get(p) for p in PERCENTILES})
        values.update({
            "total_busy_pct": row.total_busy_pct, "main_cpu_pct": row.main_cpu_pct, "cpu_source": row.cpu_source,
            "other_calls_per_s": row.other_calls_per_s, "evicted_keys": row.evicted_keys,
            "evicted_keys_per_s": row.per_s(row.evicted_keys), "keyspace_hits": row.keyspace_hits,
            "keyspace_misses": row.keyspace_misses, "keyspace_misses_per_s": row.per_s(row.keyspace_misses),
            "used_memory_bytes": row.used_memory_bytes, "maxmemory_bytes": row.maxmemory_bytes,
            "net_input_bytes": row.net_input_bytes, "net_output_bytes": row.net_output_bytes,
            "net_in_bytes_per_s": row.net_in_bytes_per_s, "net_out_bytes_per_s": row.net_out_bytes_per_s,
            "rejected_calls": row.rejected_calls, "failed_calls": row.failed_calls,
            "error_replies": row.error_replies, "errors": _errors_cell(row.errors),
            "connected_clients": row.connected_clients, "rejected_connections": row.rejected_connections,
        })
    return {c: _cell(values.get(c)) for c in CSV_COLUMNS}


def _errors_cell(errors: dict[str, int]) -> str:
    """{'ERR': 2, 'OOM': 1} -> 'ERR=2;OOM=1'."""
    return ";".join(f"{prefix}={count}" for prefix, count in sorted(errors.items()))


def write_intervals_csv(path: Path, intervals: list) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in intervals:
            writer.writerow(interval_row(row))


def _per_call(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def _usec(value: float | None) -> str:
    return f"{value:.0f} us" if value is not None else "-"


def format_interval_line(intervals: list) -> str:
    good = [i for i in intervals if not i.error]
    bad = [i for i in intervals if i.error]
    if not good:
        return "  ".join(f"shard {i.shard}: {i.error}" for i in bad) or "no data"
    end = max(i.end_s for i in good)
    total = sum(i.get_calls_per_s for i in good)
    served = sum(i.net_out_bytes_per_s for i in good)
    errors = sum(i.error_replies for i in good)
    busiest = max(good, key=lambda i: max(i.main_cpu_pct, i.total_busy_pct))
    per_command = ", ".join(f"{name.upper()} {busiest.command(name).calls_per_s:.1f}/s "
                            f"{_usec(busiest.command(name).usec_per_call)}" for name in COMMANDS)
    line = (f"[{end:7.1f} s] GET/s all shards {total:9.1f}, out {served / 1e6:.1f} MB/s, "
            f"evicted {sum(i.evicted_keys for i in good)}, misses {sum(i.keyspace_misses for i in good)}"
            + (f", {errors} error replies" if errors else "")
            + f" | busiest: shard {busiest.shard} "
            f"{busiest.main_cpu_pct:5.1f}% CPU, {busiest.total_busy_pct:5.1f}% busy "
            f"({busiest.get_busy_pct:.1f}% in GETs): {per_command}; "
            f"{(busiest.used_memory_bytes or 0) / 2**20:.0f} MiB used")
    if bad:
        line += " | failed: " + ", ".join(f"shard {i.shard} ({i.error})" for i in bad)
    return line


def _clients(value: int | None) -> str:
    return "-" if value is None else str(value)


def _latency_cell(percentiles: dict[str, float]) -> str:
    if not percentiles:
        return "-"
    return "/".join(f"{percentiles[p]:.3g}" if p in percentiles else "-" for p in PERCENTILES)


def print_summary_tables(summaries: list) -> None:
    """Per shard: calls, time, busy, CPU, evictions, memory, bytes/s, errors; then latency; then b."""
    print(f"{'shard':>5} " + " ".join(f"{name.upper() + '/s':>9} {'us/' + name.upper():>9}" for name in COMMANDS)
          + f" {'busy':>7} {'max':>7} {'main CPU':>9} {'max':>7} {'evicted':>8} {'misses':>8} {'used MiB':>9}"
          + f" {'in MB/s':>8} {'out MB/s':>9} {'max out':>8} {'clients':>7} {'errors':>7} {'rejected':>8}  url")
    for s in summaries:
        cells = " ".join(f"{s.commands[n].mean_calls_per_s:>9.1f} {_per_call(s.commands[n].usec_per_call):>9}"
                         for n in COMMANDS)
        used = f"{s.last_used_memory_bytes / 2**20:.1f}" if s.last_used_memory_bytes is not None else "-"
        print(f"{s.shard:>5} {cells} {s.mean_total_busy_pct:>6.1f}% {s.max_total_busy_pct:>6.1f}% "
              f"{s.mean_main_cpu_pct:>8.1f}% {s.max_main_cpu_pct:>6.1f}% {s.evicted_keys:>8} {s.keyspace_misses:>8} "
              f"{used:>9} {s.mean_net_in_bytes_per_s / 1e6:>8.2f} {s.mean_net_out_bytes_per_s / 1e6:>9.2f} "
              f"{s.max_net_out_bytes_per_s / 1e6:>8.2f} {_clients(s.last_connected_clients):>7} "
              f"{s.error_replies:>7} {s.rejected_calls:>8}  {s.url}")
    print("server latency per command, us, " + "/".join(PERCENTILES)
          + " (INFO latencystats: since the server's start or CONFIG RESETSTAT)")
    print(f"{'shard':>5} " + " ".join(f"{name.upper():>22}" for name in COMMANDS) + "  errors by type")
    for s in summaries:
        cells = " ".join(f"{_latency_cell(s.commands[n].latency_usec):>22}" for n in COMMANDS)
        errors = ", ".join(f"{prefix} {count}" for prefix, count in sorted(s.errors.items())) or "-"
        print(f"{s.shard:>5} {cells}  {errors}")
    print("b, bytes/s each shard served (INFO stats total_net_output_bytes), kv-sizing's --instance-gbps; "
          "the shard's capacity only where it was saturated (main thread near 100% busy):")
    for s in summaries:
        print(f"  shard {s.shard}: mean {s.mean_net_out_bytes_per_s / 1e9:.3f} GB/s, busiest interval "
              f"{s.max_net_out_bytes_per_s / 1e9:.3f} GB/s (main thread max {s.max_total_busy_pct:.1f}% busy)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(TOOL, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    from . import valkey_plots
    from .valkey_sampler import Sampler, expand_targets, summarize_shards

    targets = expand_targets(args.url_template, args.shards, args.url)
    out = prepare_out_dir(args.out, TOOL)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    sampler = Sampler(targets, timeout_s=args.timeout)
    try:
        sampler.check_all()
        until = f"for {args.duration:g} s" if args.duration else "until Ctrl-C"
        print(f"{TOOL}: sampling {len(targets)} shard(s) every {args.interval:g} s {until}; results in {out}",
              file=sys.stderr, flush=True)

        def on_intervals(new: list) -> None:
            if not args.quiet:
                print(format_interval_line(new), file=sys.stderr, flush=True)

        intervals = sampler.run(args.interval, args.duration, stop, on_intervals)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sampler.close()

    write_intervals_csv(out / "intervals.csv", intervals)
    summaries = summarize_shards(targets, intervals)
    (out / "summary.json").write_text(json.dumps({
        "interval_s": args.interval,
        "shards": [asdict(s) for s in summaries],
        "failed_samples": sampler.failed_samples,
        "stopped_by_signal": stop.is_set(),
    }, indent=2) + "\n", encoding="utf-8")
    plotted = bool(intervals) and not args.no_plots
    if plotted:
        title = f"Valkey: {len(targets)} shard(s), {args.interval:g} s intervals"
        valkey_plots.plot_valkey(out / "valkey_stats.png", intervals, title)
    print_summary_tables(summaries)
    written = "intervals.csv, summary.json" + (", valkey_stats.png" if plotted else "")
    print(f"written: {out}/{written}")
    if sampler.failed_samples:
        return fail(f"{sampler.failed_samples} sample(s) failed; see the error column of {out / 'intervals.csv'}",
                    EXIT_FAILED, TOOL)
    return EXIT_OK
