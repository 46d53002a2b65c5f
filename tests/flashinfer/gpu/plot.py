#!/usr/bin/env python3
"""Plot a GPU harness result (run.py --json FILE) as a PNG.

Left: microseconds per call of the pristine and the patched activation kernel per shape
(log scale, ratio on top of each pair; shapes named by kind: decode, prefill, tp8, tile,
slots). Right: the patched kernel's bandwidth for the bytes
it must move, as a share of the measured device-to-device copy bandwidth, with the issue's
50% goal drawn in.

    python3 tests/flashinfer/gpu/plot.py RESULT.json OUT.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REQUIRED_TIMING_KEYS = ("tokens", "routing", "pristine_us", "patched_us", "ratio", "copy_fraction")


class ResultError(ValueError):
    pass


def load_result(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultError(f"{path}: not a readable harness result ({exc})") from exc
    timings = data.get("timings") if isinstance(data, dict) else None
    if not timings:
        raise ResultError(f"{path}: no 'timings' (was it written by run.py --json?)")
    for i, t in enumerate(timings):
        missing = [k for k in REQUIRED_TIMING_KEYS if k not in t]
        if missing:
            raise ResultError(f"{path}: timings[{i}] lacks {', '.join(missing)}")
    return data


def _label(t: dict) -> str:
    """'32k\nrandom' for the first run's shapes; kind, tokens, width and variant for later runs."""
    tokens = f"{t['tokens'] // 1024}k" if t["tokens"] >= 1024 else str(t["tokens"])
    if "kind" not in t:
        return f"{tokens}\n{t['routing']}"
    variant = [v for v, on in (("slots", t.get("walk") == "slots"), ("pdl", t.get("pdl")),
                               (f"tile{t.get('tile')}", t["kind"] == "tile"),
                               (t["routing"], t["routing"] != "random")) if on]
    return "\n".join([f"{t['kind']} {tokens}", f"w{t.get('width', '?')}", *variant])


def plot(data: dict, out: Path, goal_fraction: float = 0.5) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timings = data["timings"]
    labels = [_label(t) for t in timings]
    xs = range(len(timings))
    many = len(timings) > 8  # a later run's grid: one panel above the other, labels upright
    if many:
        labels = [label.replace("\n", " ") for label in labels]
        fig, (left, right) = plt.subplots(2, 1, figsize=(max(12, 0.45 * len(timings)), 10))
    else:
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rotation = 90 if many else 0
    width = 0.38
    left.bar([x - width / 2 for x in xs], [t["pristine_us"] for t in timings], width, label="pristine")
    left.bar([x + width / 2 for x in xs], [t["patched_us"] for t in timings], width, label="patched")
    for x, t in zip(xs, timings):
        left.annotate(f"{t['ratio']:.1f}x", (x, max(t["pristine_us"], t["patched_us"])), ha="center",
                      va="bottom", fontsize=7 if many else 8, rotation=rotation)
    left.set_yscale("log")
    left.set_ylabel("us per call (median, L2 flushed)")
    left.set_xticks(list(xs), labels, rotation=rotation, fontsize=8 if many else None)
    left.set_title("DeepSeek FP8 activation, top-k 8 (EP8: 32 of 256 experts local; tp8: all 256)")
    left.legend()
    right.bar(list(xs), [100 * t["copy_fraction"] for t in timings], color="tab:orange")
    right.axhline(100 * goal_fraction, color="black", linestyle="--", linewidth=1,
                  label=f"goal {goal_fraction:.0%}")
    right.set_ylim(0, 100)
    right.set_ylabel("patched: % of device copy bandwidth")
    right.set_xticks(list(xs), labels, rotation=rotation, fontsize=8 if many else None)
    right.set_title(f"copy bandwidth {data.get('copy_GBps', 0):.0f} GB/s")
    right.legend()
    title = f"{data.get('gpu', '?')} ({data.get('arch', '?')})"
    if data.get("nvcc"):
        title += f", {data['nvcc'].split(';')[0]}"
    if data.get("cross_device_note"):
        title += f"\n{data['cross_device_note']}"
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="JSON written by run.py --json")
    p.add_argument("png", type=Path)
    args = p.parse_args(argv)
    try:
        data = load_result(args.result)
    except ResultError as exc:
        print(f"plot.py: {exc}", file=sys.stderr)
        return 2
    plot(data, args.png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
