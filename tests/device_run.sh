#!/usr/bin/env bash
# Both GPU checks in one call of the device tool, inside its 600 s limit per call (a drawn
# task has 15 device-minutes in all, the machine's start included):
#   1. the activation kernel's harness (issue 19): tests/flashinfer/gpu/device_run.sh
#   2. LMCache's gpu-marked tests (issues 14 and 15): tests/lmcache/gpu/device_run.sh
# Each part has its own time budget and its own folder of results under $OUT, so a part that
# runs out of time or fails leaves the other's results whole.
#
# Make both bundles here first (about a minute; 13 + 14 MiB, inside the 64 MiB carry limit):
#   DIST_CUDA_HOME=work/toolchain/lib/python3.11/site-packages/nvidia/cu13 \
#     work/venv/bin/python tests/flashinfer/gpu/run.py --make-bundle work/activation-bundle
#   work/venv/bin/python tests/lmcache/gpu/make_bundle.py
# then, on a task that has a GPU:
#   run(command="OUT=$OUT tests/device_run.sh", timeout_s=595,
#       carry=["work/activation-bundle", "work/lmcache-gpu-bundle"])
# Results: $OUT/activation/ (activation.log, .json, .png), $OUT/lmcache/ (lmcache-gpu.log,
# .json, build.log, junit*.xml), $OUT/device-run.tsv (part, seconds, exit status).
# Environment: ACTIVATION_S (default 220) and TOTAL_S (default 570) bound the parts; the
# LMCache part gets what the first leaves. ACTIVATION_BUNDLE and LMCACHE_BUNDLE name the
# bundles (defaults: the folders above). Exit: 0 both passed, else the first non-zero
# status of the two (each part's own: see its script).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT to the directory for the results}"
ACTIVATION_S=${ACTIVATION_S:-220}
TOTAL_S=${TOTAL_S:-570}
ACTIVATION_BUNDLE=${ACTIVATION_BUNDLE:-work/activation-bundle}
LMCACHE_BUNDLE=${LMCACHE_BUNDLE:-work/lmcache-gpu-bundle}
mkdir -p "$OUT/activation" "$OUT/lmcache"
: > "$OUT/device-run.tsv"
started=$SECONDS

part() {  # part NAME SECONDS CMD...: run CMD in its own process group under a deadline
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name: up to $limit s ($(date -u +%H:%M:%S))"
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  [ "$rc" != 124 ] || echo "=== $name: stopped at its limit of $limit s"
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - t0))" "$rc" >> "$OUT/device-run.tsv"
  echo "=== $name: exit $rc in $((SECONDS - t0)) s"
  return "$rc"
}

part activation "$ACTIVATION_S" env OUT="$OUT/activation" tests/flashinfer/gpu/device_run.sh "$ACTIVATION_BUNDLE"
activation_rc=$?
left=$((TOTAL_S - (SECONDS - started)))
if [ "$left" -lt 60 ]; then
  echo "=== lmcache: not started, $left s left of $TOTAL_S"
  printf 'lmcache\t0\tnot started\n' >> "$OUT/device-run.tsv"
  lmcache_rc=2
else
  # LMCache's script bounds its build and each test step itself; keep them inside what is left.
  part lmcache "$left" env OUT="$OUT/lmcache" BUILD_TIMEOUT_S=$((left * 3 / 5)) TEST_TIMEOUT_S=$((left * 2 / 5)) \
    tests/lmcache/gpu/device_run.sh "$LMCACHE_BUNDLE"
  lmcache_rc=$?
fi
echo "=== device_run.sh: activation exit $activation_rc, lmcache exit $lmcache_rc, $((SECONDS - started)) s"
[ "$activation_rc" = 0 ] || exit "$activation_rc"
exit "$lmcache_rc"
