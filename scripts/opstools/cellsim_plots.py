"""The simulator's cache-tier PNG: shard utilisation, GPU busy and async timeouts over time."""
from __future__ import annotations

from pathlib import Path

from .cellsim_model import SimResult, busy_per_window
from .plots import DPI, _pyplot


def plot_cache_tier(path: Path, result: SimResult, title: str, window_s: float = 10.0) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    end = result.end_s or window_s
    starts = None
    for shard, busy in enumerate(result.shard_busy):
        shares = busy_per_window(busy, end, window_s)
        starts = [i * window_s for i in range(len(shares))]
        axes[0].step(starts, [s * 100 for s in shares], where="post", label=f"shard {shard}")
    axes[0].axhline(100, color="red", linestyle=":", linewidth=1)
    axes[0].set_ylabel(f"shard busy (% per {window_s:g} s)")
    if len(result.shard_busy) <= 8:
        axes[0].legend(loc="upper right", fontsize=7, ncol=4)
    for pod, busy in enumerate(result.gpu_busy):
        shares = busy_per_window(busy, end, window_s)
        axes[1].step([i * window_s for i in range(len(shares))], [s * 100 for s in shares], where="post",
                     label=f"pod {pod}: {result.gpu_busy_fraction():.1%} overall" if pod == 0 else f"pod {pod}")
    axes[1].set_ylabel("GPU busy (% computing)")
    axes[1].legend(loc="upper right", fontsize=7)
    if starts:
        counts = [0] * len(starts)
        for outcome in result.outcomes:
            if outcome.timed_out:
                counts[min(len(counts) - 1, int(outcome.arrival.arrival_s // window_s))] += 1
        axes[2].bar(starts, counts, width=window_s * 0.9, align="edge", color="tab:red",
                    label=f"async timeouts: {result.timeout_share():.1%} of requests")
        axes[2].legend(loc="upper right", fontsize=8)
    axes[2].set_ylabel(f"timeouts per {window_s:g} s")
    axes[2].set_xlabel("time (s after start)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].set_title(f"Cache tier | {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
