"""kv-sizing: the write-up's cost model for the LMCache L2 (Valkey) tier of a cell, as an operator tool.

geometry.py  a model's KV bytes per token and chunk from its config.json (GLM-5.3's by default), by vLLM's rule
model.py     the cost model for P pods sharing N shards (pure functions)
measure.py   what every --measure client shares: shard URLs, bounds, errors, the result
valkey_bench.py  --measure through valkey-py (the ops environment): chunk-sized GETs over a rank's connections
native.py    --measure-client lmcache: the same through LMCache's native RESP client
cli.py       the command line (scripts/kv-sizing, or python -m kvsizing from scripts/)
"""
