"""Operator tools for validating a GLM-5.3 serving deployment before it takes traffic.

Five tools, each behind a thin script in ``scripts/`` (kv-sizing, the sixth,
is the package ``scripts/kvsizing``):

- ``replay``: open-loop replay of a JSONL request stream, or a Mooncake or
  AIPerf fixed-schedule trace (``trace_*``), against an OpenAI-compatible
  endpoint: TTFT percentiles, SLA gates, CSV, PNGs and ``vllm bench serve``'s
  result JSON (``replay_cli``, ``replay_result``; ``generate`` writes
  synthetic streams, ``sweep`` runs a stream at several rates).
- ``valkey-stats``: samples ``INFO`` from every Valkey shard: per-command
  time and latency percentiles, busy share, network bytes/s, evictions,
  misses, errors, memory (``valkey_sampler``, ``valkey_plots``, ``valkey_cli``).
- ``needle``: needle-in-a-haystack prompts at exact token lengths, run cold,
  from L1, from L2 after a restart, and cold again (``needle_cli``).
- ``profile-capture``: the Nsight Systems command, the start/stop profiling
  window, and N py-spy dumps of the engine processes with the threads that
  did not move named (``profile_cli``, ``profiling``).
- ``cellsim``: a SimPy model of prefill pods loading KV from Valkey shards,
  with the mechanisms the write-up names (``cellsim_model``,
  ``cellsim_valkey``, ``cellsim_arrivals``; defaults derived in
  ``cellsim_defaults``), the write-up's figures simulated
  (``cellsim_writeup``), seeds aggregated (``cellsim_runs``) and a pods x
  shards sweep against TTFT gates (``cellsim_cli``).

Modules have one job each; the ``*_cli`` modules parse arguments and wire the
others together.
"""

__version__ = "0.1.0"
