"""valkey-stats' PNG: per command, per shard, over time (matplotlib, Agg)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .plots import DPI, _pyplot
from .valkey_sampler import COMMANDS, IntervalStats

STYLES = {"get": "-", "set": "--", "exists": ":", "mget": "-."}
NAN = float("nan")


def plot_valkey(path: Path, intervals: Sequence[IntervalStats], title: str) -> None:
    """Six stacked panels sharing the time axis, one colour per shard, one line style per command.

    1 calls/s and 2 server µs per call of GET (solid), SET (dashed), EXISTS
    (dotted), MGET (dash-dot); 3 main-thread CPU (solid) and the share of
    wall-clock time executing any command (dashed), % of one core;
    4 evicted keys/s (solid) and keyspace misses/s (dashed); 5 used memory
    (solid) against maxmemory (dotted); 6 network bytes/s out (solid: the
    bandwidth served, b) and in (dashed).
    """
    plt = _pyplot()
    fig, axes = plt.subplots(6, 1, figsize=(11, 15.5), sharex=True)
    shards = sorted({i.shard for i in intervals})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    sent = {name: any(i.command(name).calls for i in intervals if not i.error) for name in COMMANDS}
    top = 0.0
    peak = max([i.maxmemory_bytes or i.used_memory_bytes or 0 for i in intervals if not i.error], default=0)
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
    fastest = max([max(i.net_out_bytes_per_s, i.net_in_bytes_per_s) for i in intervals if not i.error], default=0)
    net_unit, net_scale = ("GB/s", 1e9) if fastest >= 1e9 else ("MB/s", 1e6)
    for n, shard in enumerate(shards):
        color = colors[n % len(colors)]
        rows = [i for i in intervals if i.shard == shard and i.error == ""]
        xs = [i.end_s for i in rows]
        for name in COMMANDS:
            if not sent[name]:
                continue
            label = f"shard {shard} {name.upper()}"
            axes[0].plot(xs, [i.command(name).calls_per_s for i in rows], linestyle=STYLES[name], marker=".",
                         color=color, label=label)
            usec = [i.command(name).usec_per_call for i in rows]
            axes[1].plot(xs, [NAN if u is None else u for u in usec], linestyle=STYLES[name], marker=".",
                         color=color, label=label)
        axes[2].plot(xs, [i.main_cpu_pct for i in rows], marker=".", color=color,
                     label=f"shard {shard}: main-thread CPU")
        axes[2].plot(xs, [i.total_busy_pct for i in rows], linestyle="--", color=color,
                     label=f"shard {shard}: executing commands")
        top = max([top, *(i.main_cpu_pct for i in rows), *(i.total_busy_pct for i in rows)])
        axes[3].plot(xs, [i.per_s(i.evicted_keys) for i in rows], marker=".", color=color,
                     label=f"shard {shard}: evicted keys")
        axes[3].plot(xs, [i.per_s(i.keyspace_misses) for i in rows], linestyle="--", color=color,
                     label=f"shard {shard}: keyspace misses")
        axes[4].plot(xs, [(i.used_memory_bytes or 0) / scale for i in rows], marker=".", color=color,
                     label=f"shard {shard}: used_memory")
        limits = {i.maxmemory_bytes for i in rows if i.maxmemory_bytes}
        for limit in limits:
            axes[4].axhline(limit / scale, color=color, linestyle=":", linewidth=1,
                            label=f"shard {shard}: maxmemory")
        axes[5].plot(xs, [i.net_out_bytes_per_s / net_scale for i in rows], marker=".", color=color,
                     label=f"shard {shard}: out (served)")
        axes[5].plot(xs, [i.net_in_bytes_per_s / net_scale for i in rows], linestyle="--", color=color,
                     label=f"shard {shard}: in")
        failed = [i for i in intervals if i.shard == shard and i.error]
        if failed:
            axes[0].plot([i.end_s for i in failed], [0] * len(failed), "x", color="red", markersize=8,
                         label="failed sample" if n == 0 else None)
    axes[0].set_ylabel("calls / s")
    axes[1].set_ylabel("µs per call (server time)")
    axes[2].set_ylabel("% of wall-clock time")
    axes[3].set_ylabel("per s")
    axes[4].set_ylabel(f"used memory ({unit})")
    axes[5].set_ylabel(f"network ({net_unit})")
    if top > 50:
        axes[2].axhline(100, color="red", linestyle=":", linewidth=1)
    axes[5].set_xlabel("time (s after start)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    if len(shards) <= 8:
        for ax in axes:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="upper right", fontsize=7, ncol=4 if ax in (axes[0], axes[1]) else 2)
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
