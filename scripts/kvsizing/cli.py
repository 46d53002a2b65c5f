"""kv-sizing: size the LMCache L2 (Valkey) tier of a P/D cell against recompute (the write-up's cost model).

Examples:

  kv-sizing --prefill-rate 16Ki/0.31s --prompt-tokens 16Ki --arrival-rate 4.8 \\
            --prefill-pods 4 --instance-gbps 1.345            # the deployed 4P cell, 8 shards
  kv-sizing --chunk-bytes 12.4MB --chunk-tokens 256 --prefill-rate 16Ki/0.31s \\
            --instance-gbps 0.9 --shards 1 --prompt-tokens 16Ki --arrival-rate 450/374s   # the write-up's run
  kv-sizing --kv-cache-dtype fp8_ds_mla ...                   # FLASHMLA_SPARSE's fp8_ds_mla rows
  kv-sizing --model-config /models/GLM-5.3-FP8/config.json ... # another checkpoint's geometry
  kv-sizing --measure resp://valkey-lmcache-0.vllm.svc.cluster.local:6379
  kv-sizing --measure 'resp://valkey-lmcache-{rank}.vllm.svc.cluster.local:6379'   # all N shards, in turn
  kv-sizing --inputs cell.yaml --measure resp://10.0.3.7:6379 --json

s comes from a model's config.json (--model-config; default GLM-5.3's,
kvsizing/glm-5.3-fp8.config.json) by vLLM 0.31.0's rule: a 576-byte MLA
latent row (kv-cache-dtype fp8, the presets; 656 with fp8_ds_mla) on every
decoder layer and a 132-byte DSA indexer row on the layers that run the
indexer (index_topk_freq 4, offset 2: 21 of GLM-5.3's 78), 78 x 576 + 21 x 132
= 47,700 B per token, 12,211,200 B per 256-token chunk (kvsizing/geometry.py).
Bandwidths are bytes per second as measured: the write-up's (0.78-0.89 GB/s
for one instance, 8.9 ms per GET on eight) moved its 12.4 MB chunks, and using
them for another chunk size assumes a GET's server time scales with its
bytes; --measure measures with this chunk (valkey-stats measures the
bandwidth each shard serves under its real load). Numbers take SI suffixes (k, M,
G = 10**3, 10**6, 10**9; Ki, Mi, Gi = 2**10..) and bytes take B (12.2MB,
47.7KB); a rate may be written COUNT/SECONDSs (16Ki/0.31s tokens per second,
450/374s requests per second).
Exit status: 0 ok, 2 bad or missing input (or the --measure-client cannot be
imported), 3 the measurement failed.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from . import geometry
from .measure import LIMITS, PRODUCTION_CONNECTIONS, ClientMissing, MeasureError, Measurement, expand_urls
from .model import GB, LOADINGS, InputError, Inputs, evaluate

MEASURE_CLIENTS = ("valkey-py", "lmcache")

FIELDS = {
    # name: (flag, help)
    "prefill_rate": ("--prefill-rate", "prefill rate R of one pod, tokens/s (e.g. 53k or 16Ki/0.31s)"),
    "instance_gbps": ("--instance-gbps", "GET bandwidth of one Valkey instance, GB/s (or --measure), as measured "
                                         "with its chunk size (the write-up's 0.78-0.89 moved 12.4 MB chunks)"),
    "prompt_tokens": ("--prompt-tokens", "prompt length n, tokens (e.g. 16Ki = 16384)"),
    "arrival_rate": ("--arrival-rate", "arrival rate lambda of cache hits at the whole cell, requests/s "
                                       "(e.g. 4.8 or 450/374s)"),
}
# Optional fields; None: derived (s from the model's config, N = W).
OPTIONAL = {"kv_bytes_per_token": None, "chunk_bytes": None, "kv_row_bytes": None, "layers": None,
            "model_config": None, "kv_cache_dtype": "fp8", "mtp_layers": 0,
            "chunk_tokens": geometry.CHUNK_TOKENS, "shards": None, "ranks": 8, "prefill_pods": 1,
            "loading": "async", "lookup_timeout_s": 4.0, "target_rho": 0.5}

_SUFFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_NUMBER = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(Ki|Mi|Gi|Ti|k|K|M|G|T)?\s*(B)?\s*$")


def parse_number(text, what: str) -> float:
    """12.2MB, 47.7KB, 53k, 16Ki, 0.9, 450/374s (a count per a duration)."""
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
        raise InputError(f"{what}: {text!r} is not a number (examples: 12.2MB, 53k, 16Ki, 450/374s)")
    return float(m.group(1)) * _SUFFIX[m.group(2) or ""]


def _read_inputs_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"--inputs {path}: {e.strerror}") from None
    try:
        return data.decode("utf-8-sig")  # a byte order mark is allowed
    except UnicodeDecodeError as e:
        raise InputError(f"--inputs {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
                         ) from None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _parse_inputs_text(path: Path, text: str):
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except ValueError as e:
            raise InputError(f"--inputs {path}: not valid JSON: {e}") from None
    try:
        import yaml  # only for YAML input files
    except ImportError:
        raise InputError(f"--inputs {path}: reading YAML needs PyYAML, which this Python cannot import "
                         "(install scripts/requirements.txt, or give the fields as JSON in a .json file)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InputError(f"--inputs {path}: not valid YAML: {_one_line(e)}") from None


def _load_inputs_file(path: Path) -> dict:
    data = _parse_inputs_text(path, _read_inputs_text(path))
    if not isinstance(data, dict):
        raise InputError(f"--inputs {path}: expected a mapping of field: value")
    known = set(FIELDS) | set(OPTIONAL)
    for key in data:
        if key not in known:
            raise InputError(f"--inputs {path}: unknown field {key!r} (fields: {', '.join(sorted(known))})")
    return data


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv-sizing", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=Path, help="a YAML/JSON file with the fields below (flags override it)")
    for name, (flag, help_) in FIELDS.items():
        p.add_argument(flag, dest=name, help=help_)
    kv = p.add_argument_group("KV bytes per token s (default: from --model-config, GLM-5.3 FP8 with the presets, "
                              f"{geometry.GLM53.describe()} = {geometry.KV_BYTES_PER_TOKEN:,} B; or one of "
                              "--kv-bytes-per-token, --chunk-bytes, --kv-row-bytes)")
    kv.add_argument("--model-config", dest="model_config", metavar="CONFIG_JSON",
                    help="a model's config.json: latent rows on every layer, DSA indexer rows where vLLM builds "
                         f"an indexer (default {geometry.MODEL_CONFIG.name}, GLM-5.3's)")
    kv.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", choices=geometry.CACHE_DTYPES,
                    help="fp8 (FLASHINFER_MLA_SPARSE, the presets: 576-byte latent rows; default) or fp8_ds_mla "
                         "(FLASHMLA_SPARSE: 656)")
    kv.add_argument("--mtp-layers", dest="mtp_layers",
                    help="MTP layers registered with speculative decoding, each with an indexer (default 0: the "
                         "presets run none)")
    kv.add_argument("--kv-bytes-per-token", dest="kv_bytes_per_token", help="s itself (e.g. 47.7KB)")
    kv.add_argument("--chunk-bytes", dest="chunk_bytes", help="bytes of one LMCache chunk; s = this / --chunk-tokens "
                    "(the write-up's chunk: 12.4MB)")
    kv.add_argument("--kv-row-bytes", dest="kv_row_bytes", metavar="B[,B...]",
                    help="a uniform model: bytes per token of each cache part on every one of --layers, summed")
    kv.add_argument("--layers", dest="layers", help="layers with KV, for --kv-row-bytes")
    p.add_argument("--chunk-tokens", dest="chunk_tokens", help=f"tokens per LMCache chunk (default "
                   f"{geometry.CHUNK_TOKENS})")
    cell = p.add_argument_group("the cell")
    cell.add_argument("--prefill-pods", dest="prefill_pods", help="prefill pods P sharing the shards (default 1)")
    cell.add_argument("--ranks", dest="ranks", help="ranks W of one prefill pod, PCP x TP (default 8)")
    cell.add_argument("--shards", dest="shards", help="Valkey instances N (default: W, one per rank, as deployed; "
                      "rank r reads instance r mod N)")
    cell.add_argument("--loading", dest="loading", choices=LOADINGS,
                      help="async (the presets' enable_async_loading, default) or sync (inside the engine step)")
    cell.add_argument("--lookup-timeout", dest="lookup_timeout_s", metavar="S",
                      help="async lookup timeout, seconds (default 4: lookup_timeout_ms of the preset)")
    cell.add_argument("--target-rho", dest="target_rho", help="tier utilisation to size for (default 0.5)")
    m = p.add_argument_group("--measure: GETs of chunk-sized values (the chunk of s) from running shards")
    m.add_argument("--measure", metavar="resp://HOST:PORT", action="append",
                   help="measure an instance's GET bandwidth and time per GET, and use it as b; repeat for more "
                        "instances, or give a template with {rank} for all N (--shards, default --ranks); they "
                        "are measured one after another and b is the slowest")
    m.add_argument("--measure-client", choices=MEASURE_CLIENTS, default="valkey-py",
                   help="valkey-py (default): the ops environment's client (scripts/requirements.txt), the "
                        "connections spread over one process per usable core; lmcache: LMCache's native C++ "
                        "RESP client, which production reads with, one instance per run; it needs "
                        "LMCache 0.5.5 with its C++ extension (lmcache.lmcache_redis) and torch importable by this "
                        "Python, as in the serving image")
    m.add_argument("--measure-seconds", type=float, default=2.0, help="benchmark duration per instance "
                   f"(default 2, max {LIMITS['seconds']:g})")
    m.add_argument("--measure-connections", type=int, default=PRODUCTION_CONNECTIONS,
                   help=f"connections to the instance, one GET in flight on each (default {PRODUCTION_CONNECTIONS}: "
                        "what one prefill rank opens, the preset's resp_num_threads; P pods loading at once put "
                        f"P x {PRODUCTION_CONNECTIONS} on a shard)")
    m.add_argument("--measure-keys", type=int, default=32,
                   help="chunk-sized values written to the instance and read in turn (default 32: 391 MB of "
                        "12.2 MB chunks; deleted afterwards)")
    m.add_argument("--measure-max-gets", type=int, default=400,
                   help="stop after this many GETs per instance (default 400)")
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
    given = any(k in raw for k in FIELDS)
    return raw, given


def _row_bytes(raw: dict) -> tuple[int, ...]:
    value = raw["kv_row_bytes"]
    parts = value if isinstance(value, list) else str(value).split(",")
    rows = tuple(_int(part.strip() if isinstance(part, str) else part, "kv_row_bytes") for part in parts)
    if not rows or any(r <= 0 for r in rows):
        raise InputError(f"kv_row_bytes: expected positive byte counts per part (e.g. 576,132), got {value!r}")
    return rows


def kv_size(raw: dict) -> tuple[float, int, str]:
    """(s in bytes per token, tokens per chunk, where s comes from)."""
    tokens = _int(raw.get("chunk_tokens", OPTIONAL["chunk_tokens"]), "chunk_tokens")
    if tokens <= 0:
        raise InputError(f"chunk_tokens: must be > 0, got {tokens}")
    given = [k for k in ("kv_bytes_per_token", "chunk_bytes", "kv_row_bytes") if raw.get(k) is not None]
    if len(given) > 1:
        raise InputError(f"give one of kv_bytes_per_token, chunk_bytes, kv_row_bytes, not {' and '.join(given)}")
    if raw.get("layers") is not None and "kv_row_bytes" not in given:
        raise InputError("layers: only with kv_row_bytes (a model's layers come from its config.json)")
    from_config = [k for k in ("model_config", "kv_cache_dtype", "mtp_layers") if raw.get(k) is not None]
    if given and from_config:
        raise InputError(f"{' and '.join(from_config)}: only when s comes from the model's config, "
                         f"not with {given[0]}")
    if given == ["kv_bytes_per_token"]:
        s = parse_number(raw["kv_bytes_per_token"], "kv_bytes_per_token")
        source = "given"
    elif given == ["chunk_bytes"]:
        chunk = parse_number(raw["chunk_bytes"], "chunk_bytes")
        if not math.isfinite(chunk) or chunk <= 0:
            raise InputError(f"chunk_bytes: must be > 0, got {chunk:g}")
        s = chunk / tokens
        source = f"{chunk:,.0f} B per {tokens}-token chunk, given"
    elif given == ["kv_row_bytes"]:
        rows = _row_bytes(raw)
        if raw.get("layers") is None:
            raise InputError("kv_row_bytes: give the layers too (--layers)")
        layers = _int(raw["layers"], "layers")
        if layers <= 0:
            raise InputError(f"layers: must be > 0, got {layers}")
        s = float(geometry.bytes_per_token(rows, layers))
        what = " + ".join(str(r) for r in rows)
        source = f"{layers} layers x ({what}) B"
    else:
        kv = model_geometry(raw)
        s = float(kv.bytes_per_token)
        if raw.get("model_config") is None:
            name = "GLM-5.3 FP8 with the presets" if kv == geometry.GLM53 else f"GLM-5.3, {kv.cache_dtype}"
        else:
            name = f"{raw['model_config']}, {kv.cache_dtype}"
        source = f"{kv.describe()}: {name}"
    if not math.isfinite(s) or s <= 0:
        raise InputError(f"kv_bytes_per_token: must be > 0, got {s:g}")
    return s, tokens, source


def model_geometry(raw: dict) -> "geometry.KVGeometry":
    """The KV geometry of --model-config (GLM-5.3's by default) with --kv-cache-dtype and --mtp-layers."""
    path = raw.get("model_config")
    dtype = raw.get("kv_cache_dtype") or OPTIONAL["kv_cache_dtype"]
    mtp = _int(raw.get("mtp_layers", OPTIONAL["mtp_layers"]), "mtp_layers")
    try:
        config = geometry.GLM53_CONFIG if path is None else geometry.load_config(Path(path))
        return geometry.from_config(config, dtype, mtp)
    except geometry.ConfigError as e:
        raise InputError(f"model_config: {e}") from None


def build_inputs(raw: dict, measured_bandwidth: float | None) -> Inputs:
    s, _, _ = kv_size(raw)
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
    ranks = _int(raw.get("ranks", OPTIONAL["ranks"]), "ranks")
    shards = raw.get("shards")
    loading = raw.get("loading", OPTIONAL["loading"])
    return Inputs(
        kv_bytes_per_token=s,
        prefill_rate=values["prefill_rate"],
        instance_bandwidth=values["instance_gbps"] * GB,
        prompt_tokens=values["prompt_tokens"],
        arrival_rate=values["arrival_rate"],
        shards=ranks if shards is None else _int(shards, "shards"),
        target_rho=parse_number(raw.get("target_rho", OPTIONAL["target_rho"]), "target_rho"),
        prefill_pods=_int(raw.get("prefill_pods", OPTIONAL["prefill_pods"]), "prefill_pods"),
        ranks=ranks,
        loading=loading,
        lookup_timeout_s=parse_number(raw.get("lookup_timeout_s", OPTIONAL["lookup_timeout_s"]), "lookup_timeout_s"),
    )


def warnings_for(i: Inputs) -> list[str]:
    if i.shards == i.ranks:
        return []
    return [f"{i.shards} instance(s) for {i.ranks} ranks: the deployment has one instance per rank "
            f"(rank r reads valkey-lmcache-r, N = W by construction); modelled as rank r reading instance r mod "
            f"{i.shards}" + (f", {i.shards - i.ranks} instance(s) idle" if i.shards > i.ranks else "")]


def _gb(x: float) -> str:
    return f"{x / GB:.3f} GB"


def _bandwidth_source(measured: list[Measurement]) -> str:
    if not measured:
        return "given"
    if len(measured) == 1:
        return f"measured at {measured[0].url}"
    return f"measured, the slowest of {len(measured)} instances: {slowest(measured).url}"


def report(i: Inputs, source: str, measured: list[Measurement] | None = None, chunk_tokens: int = 256) -> str:
    r = evaluate(i)
    chunk = i.kv_bytes_per_token * chunk_tokens
    lines = ["inputs"]
    lines.append(f"  KV bytes per token s              {i.kv_bytes_per_token:,.1f} B  ({source}; "
                 f"{chunk / 1e6:.2f} MB = {chunk / 2**20:.2f} MiB per {chunk_tokens}-token chunk)")
    lines.append(f"  prefill rate R                    {i.prefill_rate:,.0f} tokens/s")
    lines.append(f"  per-instance bandwidth b          {i.instance_bandwidth / GB:.3f} GB/s "
                 f"({_bandwidth_source(measured or [])})")
    lines.append(f"  cell                              {i.prefill_pods} prefill pod(s) x {i.ranks} ranks, "
                 f"{i.shards} instance(s) shared by every pod (B = N*b = {_gb(r.aggregate_bandwidth)}/s)")
    timeout = f", lookup timeout {i.lookup_timeout_s:g} s" if i.loading == "async" else ", inside the engine step"
    lines.append(f"  loading                           {i.loading}{timeout}")
    lines.append(f"  prompt length n                   {i.prompt_tokens:,.0f} tokens")
    lines.append(f"  arrival rate lambda (cell)        {i.arrival_rate:.3f} requests/s")
    lines.append("results")
    lines.append(f"  break-even bandwidth B* = s*R     {_gb(r.break_even_bandwidth)}/s per prompt")
    chunks = math.ceil(i.prompt_tokens / chunk_tokens)
    lines.append(f"  prompt KV n*s                     {_gb(r.prompt_bytes)}  "
                 f"({chunks} chunks of {chunk_tokens} tokens)")
    lines.append(f"  per-rank share n*s/W              {r.per_rank_bytes / 1e6:.1f} MB  "
                 f"({r.per_rank_seconds:.3f} s from its instance, alone)")
    lines.append(f"  load time T_load = n*s/B          {r.load_seconds:.3f} s  (one prompt alone)")
    lines.append(f"  recompute time n/R                {r.recompute_seconds:.3f} s")
    verdict = "yes" if r.hit_pays_off else "no"
    share = r.aggregate_bandwidth / r.break_even_bandwidth
    lines.append(f"  a hit pays off (B > B*)           {verdict}: B is {share:.0%} of B*")
    state = "steady state" if r.steady_state else "NO steady state: the queue grows while this load lasts"
    lines.append(f"  utilisation rho = lambda*T_load   {r.rho:.3f}  ({state})  [each instance: lambda*n*s/(N*b)]")
    pays = "above" if r.all_pods_pays_off else "BELOW"
    label = f"all {i.prefill_pods} pod(s) loading at once"
    lines.append(f"  {label:<34}B/P = {_gb(r.all_pods_bandwidth)}/s per prompt "
                 f"({pays} B*), T_load {r.all_pods_load_seconds:.3f} s")
    if i.loading == "async":
        if r.mean_load_seconds is None:
            lines.append("  async: load under contention      no steady state: loads queue without bound and "
                         f"time out at {i.lookup_timeout_s:g} s")
        else:
            within = "within" if r.load_within_timeout else "NOT within"
            lines.append(f"  async: mean load T_load/(1-rho)   {r.mean_load_seconds:.3f} s at "
                         f"{_gb(r.mean_prompt_bandwidth)}/s per prompt ({within} the {i.lookup_timeout_s:g} s "
                         "lookup timeout)")
    else:
        lines.append(f"  sync: pod utilisation rho_pod     {r.pod_rho_low:.3f} .. {r.pod_rho_high:.3f}  "
                     "(loads never overlap .. every load overlaps one per other pod)")
    label = f"for rho <= {i.target_rho:g}"
    lines.append(f"  {label:<34}b >= {_gb(r.instance_bandwidth_for_target)}/s per "
                 f"instance, or lambda <= {r.max_arrival_rate_for_target:.2f} requests/s at this b")
    return "\n".join(lines)


def measurement_text(m: Measurement) -> str:
    bound = ("  CLIENT-BOUND: the client used "
             f"{m.client_cpu_cores:.2f} cores in {m.client_processes} process(es) of {m.usable_cores} usable; "
             "b is a lower bound of the instance's rate" if m.client_bound else "")
    seen = (f"round p50 {m.round_p50_ms:.1f} ms, p99 {m.round_p99_ms:.1f} ms" if m.round_p50_ms is not None
            else f"each GET as its connection saw it: p50 {m.get_p50_ms:.1f} ms, p99 {m.get_p99_ms:.1f} ms")
    server = (f"; the server's time per GET {m.server_usec_per_get / 1e3:.2f} ms"
              if m.server_usec_per_get is not None else "")
    return (f"measured {m.url} with {m.client}: {m.bandwidth / GB:.3f} GB/s per instance, "
            f"{m.ms_per_get:.2f} ms per GET of {m.chunk_bytes / 1e6:.2f} MB; "
            f"{m.gets} GETs ({m.connections} connection(s), {m.keys} key(s)) in {m.seconds:.2f} s ({seen}"
            f"{server}); client CPU {m.client_cpu_seconds:.2f} s = {m.client_cpu_cores:.2f} cores of "
            f"{m.usable_cores}" + bound)


def slowest(measured: list[Measurement]) -> Measurement:
    """b of the model: rank r loads its share from instance r, so a prompt's load ends with the slowest."""
    return min(measured, key=lambda m: m.bandwidth)


def run_measurements(args: argparse.Namespace, raw: dict, chunk: int) -> list[Measurement]:
    """--measure of every instance named, one after another; InputError for bad values, ClientMissing, or
    MeasureError."""
    instances = _int(raw.get("shards") or raw.get("ranks", OPTIONAL["ranks"]), "shards")
    try:
        urls = expand_urls(args.measure, instances)
    except ValueError as e:
        raise InputError(f"--measure: {e}") from None
    if raw.get("instance_gbps") is not None:
        raise InputError("give either --instance-gbps or --measure, not both")
    if chunk > LIMITS["chunk_bytes"]:
        raise InputError(f"chunk size {chunk} bytes: above Valkey's 512 MB bulk limit")
    if args.measure_client == "lmcache":
        if len(urls) > 1:
            raise InputError("--measure-client lmcache measures one instance per run; give one URL")
        from .native import measure
    else:
        from .valkey_bench import measure
    measured = []
    for url in urls:
        if len(urls) > 1:
            print(f"kv-sizing: measuring {url} ({len(measured) + 1} of {len(urls)})", file=sys.stderr, flush=True)
        try:
            measured.append(measure(url, chunk_bytes=chunk, keys=args.measure_keys,
                                    connections=args.measure_connections, seconds=args.measure_seconds,
                                    max_gets=args.measure_max_gets))
        except ValueError as e:
            raise InputError(f"--measure: {e}") from None
    return measured


def measurements_json(measured: list[Measurement]) -> dict:
    return {"measurement": slowest(measured).as_dict(), "measurements": [m.as_dict() for m in measured]}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        raw, given = collect(args)
        s, tokens, source = kv_size(raw)
        measured: list[Measurement] = []
        if args.measure:
            try:
                measured = run_measurements(args, raw, int(round(s * tokens)))
            except ClientMissing as e:
                raise InputError(str(e)) from None
            except MeasureError as e:
                print(f"kv-sizing: error: measurement failed: {e}", file=sys.stderr)
                return 3
        if measured and not given:
            if args.json:
                print(json.dumps(measurements_json(measured), indent=2))
            else:
                print("\n".join(measurement_text(m) for m in measured))
            return 0
        inputs = build_inputs(raw, slowest(measured).bandwidth if measured else None)
        result = evaluate(inputs)
    except InputError as e:
        print(f"kv-sizing: error: {e}", file=sys.stderr)
        return 2
    warnings = warnings_for(inputs)
    for w in warnings:
        print(f"kv-sizing: warning: {w}", file=sys.stderr)
    if args.json:
        out = {"inputs": {**inputs.__dict__, "kv_source": source, "chunk_tokens": tokens},
               "results": result.as_dict(), "warnings": warnings}
        if measured:
            out.update(measurements_json(measured))
        print(json.dumps(out, indent=2))
    else:
        for m in measured:
            print(measurement_text(m))
        print(report(inputs, source, measured, tokens))
    return 0
