"""The write-up's cost model for a remote KV cache tier, for a whole P/D cell (pure functions).

Symbols (write-up, "A cost model for a cache hit"):
  n  prompt length, tokens
  s  KV bytes per token (geometry.py, from GLM-5.3's config by vLLM's rule:
     78 x 576 + 21 x 132 = 47,700 B with the presets; 12,211,200 B per
     256-token chunk)
  R  the engine's prefill rate, tokens/s (B300: a 16k prompt in 0.31 s, ~53k)
  b  GET bandwidth one Valkey instance delivers, bytes/s, as measured with
     some chunk size (the write-up's: 12.4 MB chunks); applied to the chunk
     of s, a GET's server time is taken to scale with its bytes
  W  ranks of one prefill pod (PCP x TP); chunk c belongs to rank c mod W
  N  Valkey instances; rank r reads instance r mod N. The deployment has
     N = W by construction: rank r of every pod reads shard r.
  P  prefill pods sharing the N instances
  lambda  arrival rate of requests that hit, for the whole cell, requests/s

  per-rank share   n*s/W bytes per prompt, read from one instance
  T_load = n*s/(N*b)  (one prompt alone, every instance serving it)
  T_recompute = n/R        break-even B* = s*R
  rho_tier = lambda*n*s/(N*b): each instance's utilisation
  per-prompt bandwidth under contention: N*b alone, N*b/P while every pod
  loads at once (four pods on the 8 shards: 10.76/4 = 2.69 GB/s, about B*).
  sync loading: the load runs inside the engine step and freezes the pod's
  lockstep ranks, so a pod loads one prompt at a time (at most P loads share
  the tier) and is a queue with rho_pod = (lambda/P) * (its load time),
  between (lambda/P)*T_load (loads never overlap) and lambda*T_load (every
  load overlaps one of each other pod, P*T_load each).
  async loading: the load delays only its own request, so loads are not
  bounded by the pods: an instance shares itself among the GETs in flight
  (processor sharing, M/G/1-PS), a load takes T_load/(1 - rho_tier) on
  average, a prompt gets N*b*(1 - rho_tier); past the lookup timeout it is
  recomputed.

Units: bytes and bytes/s throughout; GB means 10**9 bytes as in the write-up.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

GB = 1e9
LOADINGS = ("sync", "async")


class InputError(ValueError):
    """An input the model cannot use (missing, zero, negative, not a number)."""


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{name}: expected a finite number, got {value!r}")
    if value <= 0:
        raise InputError(f"{name}: must be > 0, got {value!r}")


def _count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name}: expected an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class Inputs:
    kv_bytes_per_token: float  # s
    prefill_rate: float  # R, tokens/s
    instance_bandwidth: float  # b, bytes/s per Valkey instance
    prompt_tokens: float  # n
    arrival_rate: float  # lambda, requests/s of the whole cell
    shards: int = 1  # N
    target_rho: float = 0.5
    prefill_pods: int = 1  # P
    ranks: int = 8  # W
    loading: str = "async"
    lookup_timeout_s: float = 4.0  # configs/prefill/lmcache.yaml lookup_timeout_ms

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "prefill_rate", "instance_bandwidth", "prompt_tokens", "arrival_rate",
                     "lookup_timeout_s"):
            _positive(name, getattr(self, name))
        for name in ("ranks", "shards", "prefill_pods"):
            _count(name, getattr(self, name))
        t = self.target_rho
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < 1):
            raise InputError(f"target_rho: must be between 0 and 1 (exclusive), got {t!r}")
        if self.loading not in LOADINGS:
            raise InputError(f"loading: expected sync or async, got {self.loading!r}")


@dataclass(frozen=True)
class Result:
    break_even_bandwidth: float  # B* = s*R, bytes/s
    prompt_bytes: float  # n*s
    per_rank_bytes: float  # n*s/W: one rank's share, read from one instance
    per_rank_seconds: float  # that share at one instance's rate, alone
    aggregate_bandwidth: float  # B = N*b (N at most W): one prompt alone
    load_seconds: float  # T_load, one prompt alone
    recompute_seconds: float  # T_recompute
    hit_pays_off: bool  # N*b > B*
    rho: float  # rho_tier = lambda*n*s/(N*b), each instance
    steady_state: bool  # rho_tier < 1
    all_pods_bandwidth: float  # N*b/P: every pod loading at once
    all_pods_load_seconds: float  # P*T_load
    all_pods_pays_off: bool  # N*b/P > B*
    mean_prompt_bandwidth: float | None  # async: N*b*(1 - rho_tier); None without a steady state or for sync
    mean_load_seconds: float | None  # async: T_load/(1 - rho_tier)
    load_within_timeout: bool | None  # async: mean load time < the lookup timeout
    pod_rho_low: float | None  # sync: (lambda/P)*T_load
    pod_rho_high: float | None  # sync: lambda*T_load
    instance_bandwidth_for_target: float  # b with rho_tier = target
    max_arrival_rate_for_target: float  # lambda with rho_tier = target at this b
    shards_match_ranks: bool  # N == W, the deployment's shape

    def as_dict(self) -> dict:
        return asdict(self)


def evaluate(i: Inputs) -> Result:
    b_star = i.kv_bytes_per_token * i.prefill_rate
    prompt_bytes = i.prompt_tokens * i.kv_bytes_per_token
    per_rank = prompt_bytes / i.ranks
    # Rank r reads instance r mod N: more instances than ranks leave some idle.
    aggregate = min(i.shards, i.ranks) * i.instance_bandwidth
    t_load = prompt_bytes / aggregate
    rho = i.arrival_rate * t_load
    steady = rho < 1
    all_pods_bw = aggregate / i.prefill_pods
    mean_bw = mean_t = within = low = high = None
    if i.loading == "async":
        if steady:
            mean_bw, mean_t = aggregate * (1 - rho), t_load / (1 - rho)
        within = mean_t is not None and mean_t < i.lookup_timeout_s
    else:
        low, high = i.arrival_rate / i.prefill_pods * t_load, rho
    return Result(
        break_even_bandwidth=b_star,
        prompt_bytes=prompt_bytes,
        per_rank_bytes=per_rank,
        # With N < W one instance serves W/N ranks' shares: W/N times as long.
        per_rank_seconds=per_rank * math.ceil(i.ranks / i.shards) / i.instance_bandwidth,
        aggregate_bandwidth=aggregate,
        load_seconds=t_load,
        recompute_seconds=i.prompt_tokens / i.prefill_rate,
        hit_pays_off=aggregate > b_star,
        rho=rho,
        steady_state=steady,
        all_pods_bandwidth=all_pods_bw,
        all_pods_load_seconds=prompt_bytes / all_pods_bw,
        all_pods_pays_off=all_pods_bw > b_star,
        mean_prompt_bandwidth=mean_bw,
        mean_load_seconds=mean_t,
        load_within_timeout=within,
        pod_rho_low=low,
        pod_rho_high=high,
        instance_bandwidth_for_target=i.arrival_rate * prompt_bytes / (min(i.shards, i.ranks) * i.target_rho),
        max_arrival_rate_for_target=i.target_rho * aggregate / prompt_bytes,
        shards_match_ranks=i.shards == i.ranks,
    )
