"""kv-sizing: size a remote KV cache tier against recompute (the write-up's cost model).

Examples (the write-up's numbers):

  kv-sizing --chunk-bytes 12.4MB --chunk-tokens 256 --prefill-rate 16Ki/0.31s \\
            --instance-gbps 0.9 --prompt-tokens 16Ki --arrival-rate 450/374s
  kv-sizing ... --instance-gbps 1.345 --shards 8
  kv-sizing --measure resp://valkey-lmcache-0.vllm.svc.cluster.local:6379
  kv-sizing --inputs cell.yaml --measure resp://10.0.3.7:6379 --json

Numbers take SI suffixes (k, M, G = 10**3, 10**6, 10**9; Ki, Mi, Gi = 2**10..)
and bytes take B (12.4MB, 48.4KB); a rate may be written COUNT/SECONDSs
(16Ki/0.31s tokens per second, 450/374s requests per second).
Exit status: 0 ok, 2 bad or missing input, 3 the measurement failed.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from .model import GB, InputError, Inputs, evaluate
from .resp import LIMITS, MeasureError, measure, parse_resp_url

FIELDS = {
    # name: (flag, help)
    "kv_bytes_per_token": ("--kv-bytes-per-token", "KV bytes per token s (e.g. 48.4KB); or --chunk-bytes"),
    "prefill_rate": ("--prefill-rate", "prefill rate R, tokens/s (e.g. 53k or 16Ki/0.31s)"),
    "instance_gbps": ("--instance-gbps", "GET bandwidth of one Valkey instance, GB/s (or --measure)"),
    "prompt_tokens": ("--prompt-tokens", "prompt length n, tokens (e.g. 16Ki = 16384)"),
    "arrival_rate": ("--arrival-rate", "arrival rate lambda of cache hits, requests/s (e.g. 1.2 or 450/374s)"),
}
OPTIONAL = {"shards": 1, "target_rho": 0.5, "chunk_tokens": 256, "chunk_bytes": None}

_SUFFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_NUMBER = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(Ki|Mi|Gi|Ti|k|K|M|G|T)?\s*(B)?\s*$")


def parse_number(text, what: str) -> float:
    """12.4MB, 48.4KB, 53k, 16Ki, 0.9, 450/374s (a count per a duration)."""
    if isinstance(text, bool):
        raise InputError(f"{what}: expected a number, got {text!r}")
    if isinstance(text, (int, float)):
        return float(text)
    if not isinstance(text, str):
        raise InputError(f"{what}: expected a number, got {text!r}")
    if "/" in text:
        count, _, duration = text.partition("/")
        seconds = duration.strip()
        if seconds.endswith("s"):
            seconds = seconds[:-1]
        num = parse_number(count, what)
        den = parse_number(seconds, what)
        if den <= 0:
            raise InputError(f"{what}: {text!r} divides by {den:g} s")
        return num / den
    m = _NUMBER.match(text)
    if not m:
        raise InputError(f"{what}: {text!r} is not a number (examples: 12.4MB, 53k, 16Ki, 450/374s)")
    return float(m.group(1)) * _SUFFIX[m.group(2) or ""]


def _load_inputs_file(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        raise InputError(f"--inputs {path}: {e.strerror}") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml  # only for YAML input files

            data = yaml.safe_load(text)
    except Exception as e:
        raise InputError(f"--inputs {path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    if not isinstance(data, dict):
        raise InputError(f"--inputs {path}: expected a mapping of field: value")
    known = set(FIELDS) | set(OPTIONAL)
    for key in data:
        if key not in known:
            raise InputError(f"--inputs {path}: unknown field {key!r} (fields: {', '.join(sorted(known))})")
    return data


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv-sizing", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=Path, help="a YAML/JSON file with the fields below (flags override it)")
    for name, (flag, help_) in FIELDS.items():
        p.add_argument(flag, dest=name, help=help_)
    p.add_argument("--chunk-bytes", dest="chunk_bytes", help="LMCache chunk size in bytes (12.4MB for GLM-5.3 FP8); "
                   "with --chunk-tokens gives s, and is the value size --measure uses")
    p.add_argument("--chunk-tokens", dest="chunk_tokens", help="tokens per LMCache chunk (default 256)")
    p.add_argument("--shards", dest="shards", help="Valkey shards N a prompt's chunks are spread over (default 1)")
    p.add_argument("--target-rho", dest="target_rho", help="utilisation to size for (default 0.5)")
    p.add_argument("--measure", metavar="resp://HOST:PORT", help="measure one instance's GET bandwidth and use it as b")
    p.add_argument("--measure-seconds", type=float, default=2.0, help="benchmark duration (default 2, max 60)")
    p.add_argument("--measure-connections", type=int, default=4, help="parallel connections (default 4)")
    p.add_argument("--measure-keys", type=int, default=8, help="chunk-sized values written (default 8)")
    p.add_argument("--measure-max-gets", type=int, default=400, help="stop after this many GETs (default 400)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _int(value, what: str) -> int:
    number = parse_number(value, what)
    if number != int(number):
        raise InputError(f"{what}: expected a whole number, got {value!r}")
    return int(number)


def collect(args: argparse.Namespace) -> tuple[dict, bool]:
    """Merge --inputs and flags; returns (raw values, whether any model input was given)."""
    raw: dict = _load_inputs_file(args.inputs) if args.inputs else {}
    for name in list(FIELDS) + list(OPTIONAL):
        value = getattr(args, name, None)
        if value is not None:
            raw[name] = value
    # Only the size of a chunk? Then --measure alone runs, without the model.
    given = any(k in raw for k in FIELDS if k != "kv_bytes_per_token")
    return raw, given


def chunk_size(raw: dict) -> tuple[float | None, int]:
    tokens = _int(raw.get("chunk_tokens", OPTIONAL["chunk_tokens"]), "chunk_tokens")
    if tokens <= 0:
        raise InputError(f"chunk_tokens: must be > 0, got {tokens}")
    chunk = raw.get("chunk_bytes")
    if chunk is not None:
        chunk = parse_number(chunk, "chunk_bytes")
        if chunk <= 0:
            raise InputError(f"chunk_bytes: must be > 0, got {chunk:g}")
    return chunk, tokens


def build_inputs(raw: dict, measured_bandwidth: float | None) -> Inputs:
    chunk, tokens = chunk_size(raw)
    if "kv_bytes_per_token" in raw and chunk is not None:
        raise InputError("give either kv_bytes_per_token or chunk_bytes (with chunk_tokens), not both")
    if chunk is not None:
        raw = {**raw, "kv_bytes_per_token": chunk / tokens}
    if measured_bandwidth is not None:
        if "instance_gbps" in raw:
            raise InputError("give either --instance-gbps or --measure, not both")
        raw = {**raw, "instance_gbps": measured_bandwidth / GB}
    missing = [FIELDS[name][0] for name in FIELDS if raw.get(name) is None]
    if missing:
        raise InputError("missing input(s): " + ", ".join(missing)
                         + " (flags, or fields of the same name without '--' in --inputs)")
    values = {name: parse_number(raw[name], name) for name in FIELDS}
    for name, value in values.items():  # named as the user gave them
        if not math.isfinite(value) or value <= 0:
            raise InputError(f"{name}: must be > 0, got {value:g}")
    return Inputs(
        kv_bytes_per_token=values["kv_bytes_per_token"],
        prefill_rate=values["prefill_rate"],
        instance_bandwidth=values["instance_gbps"] * GB,
        prompt_tokens=values["prompt_tokens"],
        arrival_rate=values["arrival_rate"],
        shards=_int(raw.get("shards", OPTIONAL["shards"]), "shards"),
        target_rho=parse_number(raw.get("target_rho", OPTIONAL["target_rho"]), "target_rho"),
    )


def _gb(x: float) -> str:
    return f"{x / GB:.3f} GB"


def report(i: Inputs, measured=None, chunk_tokens: int = 256) -> str:
    r = evaluate(i)
    lines = ["inputs"]
    lines.append(f"  KV bytes per token s              {i.kv_bytes_per_token:,.1f} B"
                 f"  ({i.kv_bytes_per_token * chunk_tokens / 1e6:.2f} MB per {chunk_tokens}-token chunk)")
    lines.append(f"  prefill rate R                    {i.prefill_rate:,.0f} tokens/s")
    source = f"measured at {measured.url}" if measured else "given"
    lines.append(f"  per-instance bandwidth b          {i.instance_bandwidth / GB:.3f} GB/s ({source})")
    lines.append(f"  shards N                          {i.shards}  (aggregate B = N*b = {_gb(r.aggregate_bandwidth)}/s)")
    lines.append(f"  prompt length n                   {i.prompt_tokens:,.0f} tokens")
    lines.append(f"  arrival rate lambda               {i.arrival_rate:.3f} requests/s")
    lines.append("results")
    lines.append(f"  break-even bandwidth B* = s*R     {_gb(r.break_even_bandwidth)}/s per prompt")
    chunks = math.ceil(i.prompt_tokens / chunk_tokens)
    lines.append(f"  prompt KV n*s                     {_gb(r.prompt_bytes)}  ({chunks} chunks of {chunk_tokens} tokens)")
    lines.append(f"  load time T_load = n*s/B          {r.load_seconds:.3f} s")
    lines.append(f"  recompute time n/R                {r.recompute_seconds:.3f} s")
    verdict = "yes" if r.hit_pays_off else "no"
    share = r.aggregate_bandwidth / r.break_even_bandwidth
    lines.append(f"  a hit pays off (B > B*)           {verdict}: B is {share:.0%} of B*")
    state = "steady state" if r.steady_state else "NO steady state: the queue grows while this load lasts"
    lines.append(f"  utilisation rho = lambda*T_load   {r.rho:.3f}  ({state})")
    n = r.shards_for_target_rho
    t = r.prompt_bytes / (n * i.instance_bandwidth)
    lines.append(f"  smallest N for rho <= {i.target_rho:g}        {n}  (T_load {t:.3f} s, rho {i.arrival_rate * t:.3f})")
    lines.append(f"  smallest N for B > B*             {r.shards_for_break_even}")
    return "\n".join(lines)


def measurement_text(m) -> str:
    return (f"measured {m.url} ({m.server}): {m.bandwidth / GB:.3f} GB/s per instance, "
            f"{m.gets} GETs of {m.chunk_bytes / 1e6:.2f} MB over {m.connections} connections in {m.seconds:.2f} s "
            f"(GET p50 {m.get_p50_ms:.1f} ms, p99 {m.get_p99_ms:.1f} ms)")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        raw, given = collect(args)
        measured = None
        if args.measure:
            try:
                parse_resp_url(args.measure)
            except ValueError as e:
                raise InputError(f"--measure: {e}") from None
            if raw.get("instance_gbps") is not None:
                raise InputError("give either --instance-gbps or --measure, not both")
            chunk, tokens = chunk_size(raw)
            if chunk is None and raw.get("kv_bytes_per_token") is not None:
                chunk = parse_number(raw["kv_bytes_per_token"], "kv_bytes_per_token") * tokens
            chunk = int(round(chunk if chunk is not None else 12_400_000))
            if chunk > LIMITS["chunk_bytes"]:
                raise InputError(f"chunk size {chunk} bytes: above Valkey's 512 MB bulk limit")
            try:
                measured = measure(args.measure, chunk_bytes=chunk, keys=args.measure_keys,
                                   connections=args.measure_connections, seconds=args.measure_seconds,
                                   max_gets=args.measure_max_gets)
            except ValueError as e:
                raise InputError(f"--measure: {e}") from None
        if measured is not None and not given:
            print(json.dumps({"measurement": measured.as_dict()}, indent=2) if args.json else measurement_text(measured))
            return 0
        inputs = build_inputs(raw, measured.bandwidth if measured else None)
        result = evaluate(inputs)
    except InputError as e:
        print(f"kv-sizing: error: {e}", file=sys.stderr)
        return 2
    except MeasureError as e:
        print(f"kv-sizing: error: measurement failed: {e}", file=sys.stderr)
        return 3
    if args.json:
        out = {"inputs": inputs.__dict__, "results": result.as_dict()}
        if measured:
            out["measurement"] = measured.as_dict()
        print(json.dumps(out, indent=2))
    else:
        if measured:
            print(measurement_text(measured))
        print(report(inputs, measured, chunk_size(raw)[1]))
    return 0
