#!/usr/bin/env bash
# Every GPU check in one run on a GPU host that has PyTorch and nvcc but neither the source trees
# nor a package index:
#   activation  FlashInfer's activation harness: tests/flashinfer/gpu/device_run.sh
#   lmcache     LMCache's gpu-marked tests: tests/lmcache/gpu/device_run.sh
#
# First, on the build host: `make gpu-bundles` (work/activation-bundle, work/lmcache-gpu-bundle, each stamped
# with the series it was made from). Then, from the repository root on the GPU host, with
# both bundles copied with the working tree:
#   OUT=/results tests/device_run.sh
# Each bundle's stamp is printed first and a bundle made from another series is refused.
#
# The two parts run side by side: LMCache's part builds its CUDA extension on the CPUs while the
# activation harness has the GPU, and starts its GPU steps only once the harness is done (the
# file $GPU_FREE), so that nothing else runs on the GPU while the harness times its kernels.
# Each part has its own deadline inside TOTAL_S, the parts' steps deadlines inside theirs: a part
# is stopped GRACE_S (10) after its limit, and its steps end GRACE_S before it. The limits are
# printed ("=== limits") and checked before anything runs (exit 2 naming the one at fault).
#
# $OUT receives seven files (the GPU host hands back at most eight):
#   device-run.tsv                         part, seconds, exit status
#   activation.log .json .png              the harness (its JSON rewritten after every case)
#   lmcache-gpu.log .json                  LMCache's part (its JSON rewritten after every step)
#   details.tar.gz                         everything else: build logs, junit XML, env, steps
# Environment: TOTAL_S (default 540: leave the call's own limit a margin above it),
# ACTIVATION_S (default 300), ACTIVATION_BUNDLE, LMCACHE_BUNDLE (defaults: the folders above).
# PYTHON (default python3) is the machine's torch Python for both parts.
# Exit: 0 both passed, else the first non-zero status (activation's, then lmcache's); 2 also for
# limits that do not fit.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT to the directory for the results}"
TOTAL_S=${TOTAL_S:-540}
ACTIVATION_S=${ACTIVATION_S:-300}
ACTIVATION_BUNDLE=${ACTIVATION_BUNDLE:-work/activation-bundle}
LMCACHE_BUNDLE=${LMCACHE_BUNDLE:-work/lmcache-gpu-bundle}
DETAILS=${TMPDIR:-/tmp}/dist-device-run
rm -rf "$DETAILS" && mkdir -p "$OUT" "$DETAILS/activation" "$DETAILS/lmcache" || exit 2
: > "$OUT/device-run.tsv"
export GPU_FREE=$DETAILS/gpu-free
started=$SECONDS
GRACE_S=10
lmcache_s=$((TOTAL_S - 15))
for value in TOTAL_S ACTIVATION_S; do
  [[ ${!value} =~ ^[0-9]+$ ]] || { echo "device_run.sh: $value=${!value} is not a number of seconds" >&2; exit 2; }
done
[ $((ACTIVATION_S + GRACE_S)) -le "$lmcache_s" ] \
  || { echo "device_run.sh: ACTIVATION_S=$ACTIVATION_S does not fit in TOTAL_S=$TOTAL_S (at most $((lmcache_s - GRACE_S)))" >&2; exit 2; }
echo "=== limits: total $TOTAL_S s; activation $ACTIVATION_S s (steps within $((ACTIVATION_S - GRACE_S)));" \
  "lmcache $((lmcache_s + GRACE_S)) s (steps within $lmcache_s); grace $GRACE_S s"

# The bundles' stamps, first: what this run is of. A stale one is refused again by its part.
echo "=== bundles"
PYTHONPATH=build python3 -m distbuild.host.gpubundles check "$ACTIVATION_BUNDLE" "$LMCACHE_BUNDLE" 2>&1 \
  || echo "=== bundles: not this tree's (above); each part refuses its own"

part() {  # part NAME SECONDS CMD...: run CMD in its own process group under a deadline
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name: up to $limit s ($(date -u +%H:%M:%S))"
  timeout --kill-after="$GRACE_S" "$limit" "$@"
  rc=$?
  [ "$rc" != 124 ] || echo "=== $name: stopped at its limit of $limit s"
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - t0))" "$rc" >> "$OUT/device-run.tsv"
  echo "=== $name: exit $rc in $((SECONDS - t0)) s"
  return "$rc"
}

# LMCache's part ends before TOTAL_S with its summary written: its steps take their limits
# from its own deadline, and its outer limit here is only the backstop.
part lmcache "$((lmcache_s + GRACE_S))" env OUT="$OUT" DETAILS="$DETAILS/lmcache" DEADLINE_S="$lmcache_s" \
  MAX_JOBS="$(( $(nproc) > 8 ? $(nproc) - 4 : $(nproc) ))" tests/lmcache/gpu/device_run.sh "$LMCACHE_BUNDLE" \
  > "$DETAILS/lmcache-part.out" 2>&1 &
lmcache_pid=$!

part activation "$ACTIVATION_S" env OUT="$OUT" BUILD_DIR="$DETAILS/activation" DEADLINE_S="$((ACTIVATION_S - GRACE_S))" \
  tests/flashinfer/gpu/device_run.sh "$ACTIVATION_BUNDLE"
activation_rc=$?
touch "$GPU_FREE"
wait "$lmcache_pid"
lmcache_rc=$?
cat "$DETAILS/lmcache-part.out"

tar -czf "$OUT/details.tar.gz" -C "$DETAILS" . 2>/dev/null || echo "device_run.sh: details.tar.gz incomplete"
echo "=== device_run.sh: activation exit $activation_rc, lmcache exit $lmcache_rc, $((SECONDS - started)) s;" \
  "$(find "$OUT" -type f | wc -l) files in $OUT"
[ "$activation_rc" = 0 ] || exit "$activation_rc"
exit "$lmcache_rc"
