#!/usr/bin/env python3
"""Where the activation kernels' time goes at decode sizes, pristine beside patched.

At 1 to 16 tokens each kernel takes a few microseconds, about a launch and two or three round
trips to memory, and run.py's timing (L2 flushed before every call) cannot say which part differs.
This probe times the same libraries three ways on the decode shapes, the revisions interleaved
call by call:

* ``flushed``: as run.py (L2 flushed before each call): data, indices, parameters and the
  kernel's instructions all come from DRAM;
* ``warm``: no flush, so the second and later calls find all of those in L2;
* ``graph``: 20 launches replayed from a CUDA graph, no flush: device time per launch without
  the host's launch path.

With ``--launch-only`` it launches each (revision, shape) three times and exits, for Nsight
Compute (``ncu --metrics gpu__time_duration.sum``: the kernel alone, caches flushed, clocks at
base), and writes that order to ``--json``; ``--ncu-summary CSV`` then reads ncu's CSV in that
order and prints the median duration of each (revision, shape).

  decode_probe.py --bundle DIR [--previous DIR] --out BUILD_DIR [--json FILE]
  decode_probe.py --bundle DIR [--previous DIR] --out BUILD_DIR --json ORDER --launch-only
  decode_probe.py --ncu-summary CSV --json ORDER

``--previous`` names an overlay of an earlier patched revision (a folder like a bundle's
``pristine/``: OVERLAY_ROOTS and the files that differ), built and timed as a third revision.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import activation_build as ab  # noqa: E402
import run  # noqa: E402

SHAPES = [("decode", run.Shape(n)) for n in (1, 2, 8, 16)] + [
    ("tp8", run.Shape(n, **run.TP8)) for n in (1, 16)] + [("decode", run.Shape(64))]
GRAPH_LAUNCHES = 20


def libraries(args) -> dict[str, "run.Library"]:
    revs = run.revisions(argparse.Namespace(bundle=args.bundle, work=None), Path(args.out))
    if args.previous:
        prev = Path(args.previous)
        revs.append(ab.Sources("previous", revs[1].tree, prev, tuple((prev / run.OVERLAY_ROOTS).read_text().split())))
    arch = run.detect_arch()
    built = {r.name: Path(args.out) / f"libactivation_{r.name}_{arch}.so" for r in revs}
    if not (args.launch_only and all(p.is_file() for p in built.values())):
        built = run.build(revs, arch, run.find_cuda(), Path(args.out), jobs=len(revs))
    return {name: run.Library(path) for name, path in built.items()}


def ncu_summary(csv_path: Path, order_path: Path) -> list[dict]:
    """ncu's kernel durations in launch order, three per (revision, shape) as launched."""
    import csv

    order = json.loads(order_path.read_text())["launched"]
    durations = []
    with csv_path.open() as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not CSV
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0,
                     "msecond": 1e3, "ms": 1e3}[row["Metric Unit"]]
            durations.append((int(row["ID"]), float(row["Metric Value"].replace(",", "")) * scale))
    durations = [us for _, us in sorted(durations)]
    if len(durations) != 3 * len(order):
        raise SystemExit(f"{csv_path}: {len(durations)} kernel durations, {3 * len(order)} launched")
    rows = []
    for i, (name, label) in enumerate(order):
        rows.append({"revision": name, "shape": label, "us": statistics.median(durations[3 * i: 3 * i + 3])})
    by_shape: dict[str, dict[str, float]] = {}
    for r in rows:
        by_shape.setdefault(r["shape"], {})[r["revision"]] = r["us"]
    print("ncu gpu__time_duration (median of 3; caches flushed, clocks at base):", flush=True)
    for label, us in by_shape.items():
        ratios = " ".join(f"{n} {us['pristine'] / v:.2f}" for n, v in us.items() if n != "pristine")
        print(f"  {label:<28} " + " ".join(f"{n} {v:7.2f} us" for n, v in us.items()) + f"   ratios {ratios}",
              flush=True)
    return rows


def launcher(lib, case, rows_walk: bool, stream: int = 0):
    return lambda: lib.run(case, mn_limit=rows_walk and lib.has_mn_limit, stream=stream)


def graph_us(torch, fn_for_stream) -> float:
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    fn = fn_for_stream(stream.cuda_stream)
    with torch.cuda.stream(stream):
        fn()  # warm up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(GRAPH_LAUNCHES):
                fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / GRAPH_LAUNCHES)
    return statistics.median(samples)


def graph_times(torch, libs: dict, case) -> dict[str, float]:
    """Per-launch device time from a captured graph; NaN where capture fails (said once)."""
    out = {}
    for name, lib in libs.items():
        try:
            out[name] = graph_us(torch, lambda stream, lib=lib: launcher(lib, case, True, stream))
        except Exception as exc:  # a launcher the graph cannot capture: the other ways still stand
            print(f"graph capture failed for {name}: {exc}", flush=True)
            out[name] = float("nan")
    return out


def interleaved(torch, fns: dict, iters: int, flush) -> dict[str, float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(iters):
        for name, fn in fns.items():
            if flush is not None:
                flush.zero_()
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle")
    p.add_argument("--previous")
    p.add_argument("--out")
    p.add_argument("--json")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--launch-only", action="store_true")
    p.add_argument("--ncu-summary", metavar="CSV")
    args = p.parse_args(argv)
    if args.ncu_summary:
        ncu_summary(Path(args.ncu_summary), Path(args.json))
        return 0

    import numpy as np
    import torch

    run.torch_, run.np = torch, np
    libs = libraries(args)
    cases = [(kind, shape, run.Case(torch, shape, seed=7000 + i)) for i, (kind, shape) in enumerate(SHAPES)]
    if args.launch_only:
        launched = []
        for kind, shape, case in cases:
            for name, lib in libs.items():
                for _ in range(3):
                    launcher(lib, case, True)()
                torch.cuda.synchronize()
                launched.append((name, f"{kind}:{shape.label}"))
        if args.json:
            Path(args.json).write_text(json.dumps({"launched": launched}))
        return 0
    props = torch.cuda.get_device_properties(0)
    flush = torch.empty(max(2 * props.L2_cache_size, 64 << 20), dtype=torch.uint8, device="cuda")
    rows = []
    names = list(libs)
    print(f"{'shape':<28} {'way':<8} " + " ".join(f"{n + ' us':>12}" for n in names) + "   ratios to pristine",
          flush=True)
    for kind, shape, case in cases:
        fns = {n: launcher(lib, case, True) for n, lib in libs.items()}
        ways = {"flushed": interleaved(torch, fns, args.iters, flush),
                "warm": interleaved(torch, fns, args.iters, None),
                "graph": graph_times(torch, libs, case)}
        for way, us in ways.items():
            ratios = {n: us["pristine"] / us[n] for n in names if n != "pristine"}
            rows.append({"kind": kind, "shape": shape.label, "way": way, "us": us, "ratio": ratios,
                         "local_rows": int(len(case.local_rows)), "tile": case.tile})
            print(f"{kind + ':' + shape.label:<28} {way:<8} " + " ".join(f"{us[n]:>12.2f}" for n in names)
                  + "   " + " ".join(f"{n} {r:.2f}" for n, r in ratios.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": props.name, "iters": args.iters, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
