"""kv-sizing: the write-up's cost model for the LMCache L2 (Valkey) tier, as an operator tool.

model.py  the cost model (pure functions)
resp.py   a bounded GET-bandwidth benchmark against one Valkey instance (stdlib only)
cli.py    the command line (scripts/kv-sizing, or python -m kvsizing from scripts/)
"""
