"""Operator tools for validating a GLM-5.3 serving deployment before it takes traffic.

Five tools, each behind a thin script in ``scripts/``:

- ``replay``: open-loop replay of a JSONL request stream against an
  OpenAI-compatible endpoint, TTFT percentiles, SLA gates, CSV and PNGs
  (``replay_cli``; a ``generate`` subcommand writes synthetic streams).
- ``valkey-stats``: samples ``INFO commandstats cpu stats memory`` from every
  Valkey shard: per-command time, busy share, evictions, misses, memory
  (``valkey_sampler``, ``valkey_plots``, ``valkey_cli``).
- ``needle``: needle-in-a-haystack prompts at exact token lengths, run cold,
  from L1, from L2 after a restart, and cold again (``needle_cli``).
- ``profile-capture``: the Nsight Systems command, the start/stop profiling
  window, and py-spy dumps of the engine processes (``profile_cli``).
- ``cellsim``: a SimPy model of prefill pods loading KV from Valkey shards
  (``cellsim_model``), the write-up's figures simulated (``cellsim_writeup``)
  and a pods x shards sweep against TTFT gates (``cellsim_cli``).

Modules have one job each; the ``*_cli`` modules parse arguments and wire the
others together.
"""

__version__ = "0.1.0"
