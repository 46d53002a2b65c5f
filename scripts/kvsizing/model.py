"""The write-up's cost model for a remote KV cache tier (pure functions).

Symbols (write-up, "A cost model for a cache hit"):
  n  prompt length, tokens
  s  KV bytes per token (GLM-5.3 FP8: 12.4 MB per 256-token chunk, ~48 KB)
  R  the engine's prefill rate, tokens/s (B300: a 16k prompt in 0.31 s, ~53k)
  b  GET bandwidth one Valkey instance delivers, bytes/s
  N  Valkey shards; a prompt's chunks are spread over them by rank, so a load
     reads from all N in parallel: B = N * b
  lambda  arrival rate of requests that hit, requests/s

  T_load = n*s/B        T_recompute = n/R        break-even B* = s*R
  rho = lambda * T_service, T_service >= T_load for a hit loaded in the step
  (synchronous loading); rho >= 1 has no steady state.

Units: bytes and bytes/s throughout; GB means 10**9 bytes as in the write-up.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

GB = 1e9


class InputError(ValueError):
    """An input the model cannot use (missing, zero, negative, not a number)."""


@dataclass(frozen=True)
class Inputs:
    kv_bytes_per_token: float  # s
    prefill_rate: float  # R, tokens/s
    instance_bandwidth: float  # b, bytes/s per Valkey instance
    prompt_tokens: float  # n
    arrival_rate: float  # lambda, requests/s
    shards: int = 1  # N
    target_rho: float = 0.5

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "prefill_rate", "instance_bandwidth", "prompt_tokens", "arrival_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InputError(f"{name}: expected a finite number, got {value!r}")
            if value <= 0:
                raise InputError(f"{name}: must be > 0, got {value!r}")
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise InputError(f"shards: expected an integer >= 1, got {self.shards!r}")
        t = self.target_rho
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < 1):
            raise InputError(f"target_rho: must be between 0 and 1 (exclusive), got {t!r}")


@dataclass(frozen=True)
class Result:
    break_even_bandwidth: float  # B* = s*R, bytes/s
    prompt_bytes: float  # n*s
    aggregate_bandwidth: float  # B = N*b
    load_seconds: float  # T_load
    recompute_seconds: float  # T_recompute
    hit_pays_off: bool  # B > B*
    rho: float  # lambda * T_load
    steady_state: bool  # rho < 1
    shards_for_target_rho: int  # smallest N with lambda*n*s/(N*b) <= target
    shards_for_break_even: int  # smallest N with N*b > B*

    def as_dict(self) -> dict:
        return asdict(self)


def smallest_shards(load_bytes: float, per_instance: float, limit_seconds: float) -> int:
    """Smallest N with load_bytes / (N * per_instance) <= limit_seconds."""
    n = math.ceil(load_bytes / (per_instance * limit_seconds) - 1e-12)
    return max(1, n)


def evaluate(i: Inputs) -> Result:
    b_star = i.kv_bytes_per_token * i.prefill_rate
    prompt_bytes = i.prompt_tokens * i.kv_bytes_per_token
    aggregate = i.shards * i.instance_bandwidth
    t_load = prompt_bytes / aggregate
    t_recompute = i.prompt_tokens / i.prefill_rate
    rho = i.arrival_rate * t_load
    # rho <= target  <=>  T_load <= target / lambda
    shards_rho = smallest_shards(prompt_bytes, i.instance_bandwidth, i.target_rho / i.arrival_rate)
    # N*b > B*  (strictly: at equality loading and recompute cost the same)
    shards_b = math.floor(b_star / i.instance_bandwidth) + 1
    return Result(
        break_even_bandwidth=b_star,
        prompt_bytes=prompt_bytes,
        aggregate_bandwidth=aggregate,
        load_seconds=t_load,
        recompute_seconds=t_recompute,
        hit_pays_off=aggregate > b_star,
        rho=rho,
        steady_state=rho < 1,
        shards_for_target_rho=shards_rho,
        shards_for_break_even=shards_b,
    )
