"""PNG plots (matplotlib, Agg backend, no display needed).

Replay: TTFT over send time, TTFT CDF, requests in flight over time, output
throughput with TPOT/ITL and send lag. (valkey-stats' plot: valkey_plots.py.)
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .gates import TTFT_METRICS, GateResult
from .records import RequestRecord
from .stats import THIRD_NAMES, ReplaySummary, in_flight_steps, third_boundaries

DPI = 110


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _metric_name(metric: str) -> str:
    return "mean" if metric == "mean" else metric.upper()


def _gate_limits(gate_results: Sequence[GateResult]) -> dict[str, float]:
    return {r.gate.metric: r.gate.limit for r in gate_results if r.gate.metric in TTFT_METRICS}


def plot_ttft_over_time(
    path: Path, records: Sequence[RequestRecord], summary: ReplaySummary, gate_results: Sequence[GateResult], title: str
) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 5.2))
    ok = [r for r in records if r.ok and r.ttft_s is not None]
    bad = [r for r in records if not r.ok and r.sent_s is not None]
    ax.scatter([r.sent_s for r in ok], [r.ttft_s for r in ok], s=12, color="tab:blue", alpha=0.7,
               label=f"TTFT, ok ({len(ok)})")
    if bad:
        ax.scatter([r.sent_s for r in bad], [0.0] * len(bad), marker="x", s=30, color="tab:red",
                   label=f"failed ({len(bad)}), drawn at 0", zorder=3)
    limits = _gate_limits(gate_results)
    styles = {
        "p50": ("tab:orange", "--"), "p90": ("tab:red", "--"), "mean": ("tab:green", ":"), "p99": ("tab:purple", "-."),
    }
    top = max([r.ttft_s for r in ok], default=1.0)
    for metric, limit in limits.items():
        color, style = styles.get(metric, ("gray", "--"))
        label = f"gate: {_metric_name(metric)} < {limit:g} s"
        if limit <= top * 1.5:
            ax.axhline(limit, color=color, linestyle=style, linewidth=1, label=label)
        else:  # far above the data: name it rather than squash the points
            ax.plot([], [], color=color, linestyle=style, linewidth=1, label=f"{label} (above the plot)")
    bounds = third_boundaries(records)
    for x in bounds:
        ax.axvline(x, color="gray", linestyle=":", linewidth=1)
    sent = [r.sent_s for r in records if r.sent_s is not None]
    if sent and bounds:
        edges = [min(sent), *bounds, max(sent)]
        for i, (name, dist) in enumerate(zip(THIRD_NAMES, summary.ttft_thirds)):
            if dist.p50 is None:
                continue
            ax.hlines(dist.p50, edges[i], edges[i + 1], color="black", linewidth=2,
                      label="median per third" if i == 0 else None)
            ax.annotate(f"{name}: p50 {dist.p50:.2f} s", ((edges[i] + edges[i + 1]) / 2, dist.p50),
                        textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8,
                        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85})
    ax.set_xlabel("send time (s after start)")
    ax.set_ylabel("time to first token (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"TTFT over send time, thirds dotted | {title}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_ttft_cdf(
    path: Path, records: Sequence[RequestRecord], summary: ReplaySummary, gate_results: Sequence[GateResult], title: str
) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    values = sorted(r.ttft_s for r in records if r.ok and r.ttft_s is not None)
    n_all = max(summary.requests, 1)
    if values:
        # y is the share of all requests of the stream, so failures keep the curve below 1
        ys = [(i + 1) / n_all for i in range(len(values))]
        ax.step(values, ys, where="post", color="tab:blue", label=f"TTFT of {len(values)} ok requests")
    for name, value, color in (("p50", summary.ttft.p50, "tab:orange"), ("p90", summary.ttft.p90, "tab:red"),
                               ("p99", summary.ttft.p99, "tab:purple")):
        if value is not None:
            ax.axvline(value, color=color, linewidth=1, alpha=0.6, label=f"{name} {value:.2f} s")
    for metric, limit in _gate_limits(gate_results).items():
        label = f"gate: {_metric_name(metric)} < {limit:g} s"
        if values and limit <= values[-1] * 1.5:
            ax.axvline(limit, color="black", linestyle="--", linewidth=1, label=label)
        else:
            ax.plot([], [], color="black", linestyle="--", linewidth=1, label=f"{label} (off the right)")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.set_title(f"TTFT CDF (share of all requests) | {title}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_in_flight(path: Path, records: Sequence[RequestRecord], summary: ReplaySummary, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.2))
    steps = in_flight_steps(records)
    if steps:
        times = [0.0] + [t for t, _ in steps]
        levels = [0] + [n for _, n in steps]
        ax.step(times, levels, where="post", color="tab:green")
        ax.fill_between(times, levels, step="post", alpha=0.25, color="tab:green")
        peak_time, peak = max(steps, key=lambda s: s[1])
        ax.annotate(f"peak {peak}", (peak_time, peak), textcoords="offset points", xytext=(6, -12), fontsize=9)
    sent = [r.sent_s for r in records if r.sent_s is not None]
    if sent:
        ax.plot(sent, [0] * len(sent), "|", color="gray", markersize=8, label="sends")
        ax.legend(loc="upper left", fontsize=8)
    ax.set_xlabel("time (s after start)")
    ax.set_ylabel("requests in flight")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Requests in flight | {title}")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_throughput(
    path: Path, records: Sequence[RequestRecord], summary: ReplaySummary, gate_results: Sequence[GateResult],
    title: str, window_s: float = 10.0,
) -> None:
    """Three panels: output tokens/s per window of time (tokens at their arrival; the
    aggregate and the output gate as lines), TPOT and ITL distributions, send lag over send time."""
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(10, 9))
    ok = [r for r in records if r.ok]
    # every token at the time it arrived; the usage count is spread over the choices events
    stamps: list[tuple[float, float]] = []
    for r in ok:
        times = [t for t in ([r.first_token_s] + list(r.token_times_s)) if t is not None]
        if times and r.completion_tokens:
            weight = r.completion_tokens / len(times)
            stamps.extend((t, weight) for t in times)
    ax = axes[0]
    if stamps:
        end = max(t for t, _ in stamps)
        bins = max(1, int(end // window_s) + 1)
        totals = [0.0] * bins
        for t, weight in stamps:
            totals[min(bins - 1, int(t // window_s))] += weight
        ax.step([i * window_s for i in range(bins)], [v / window_s for v in totals], where="post",
                color="tab:blue", label=f"output tokens/s per {window_s:g} s")
    tput = summary.throughput
    ax.axhline(tput.output_tokens_per_s, color="black", linestyle=":", linewidth=1,
               label=f"aggregate {tput.output_tokens_per_s:.1f} tok/s; "
                     f"{tput.tokens_per_minute / 1e6:.3f}M tokens/min")
    for result in gate_results:
        if result.gate.metric == "output_tps":
            ax.axhline(result.gate.limit, color="tab:red", linestyle="--", linewidth=1,
                       label=f"gate: output >= {result.gate.limit:g} tok/s")
    ax.set_xlabel("time (s after start)")
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"Output throughput | {title}")
    ax = axes[1]
    from .stats import inter_token_latencies, tpot_s

    tpots = sorted(v * 1000 for r in ok if (v := tpot_s(r)) is not None)
    itls = sorted(gap * 1000 for r in ok for gap in inter_token_latencies(r))
    for values, name, color in ((tpots, "TPOT", "tab:green"), (itls, "ITL", "tab:orange")):
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", color=color,
                    label=f"{name} ({len(values)}): p50 {values[len(values) // 2]:.1f} ms")
    if not tpots and not itls:
        ax.text(0.5, 0.5, "no request had more than one token", transform=ax.transAxes, ha="center")
    else:
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("TPOT and ITL (ms)")
    ax.set_ylabel("share")
    ax.set_ylim(0, 1.02)
    ax = axes[2]
    lagged = [r for r in records if r.send_lag_s is not None]
    ax.plot([r.sent_s for r in lagged], [r.send_lag_s * 1000 for r in lagged], ".", color="tab:purple",
            markersize=4, label=f"send lag (p99 {summary.send_lag.p99 * 1000:.1f} ms)"
            if summary.send_lag.p99 is not None else "send lag")
    if summary.send_lag_warning:
        ax.set_title("the client fell behind its stream", color="tab:red", fontsize=9)
    ax.set_xlabel("send time (s after start)")
    ax.set_ylabel("send lag (ms)")
    ax.set_ylim(bottom=0)
    if lagged:
        ax.legend(loc="upper left", fontsize=8)
    for a in axes:
        a.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)

