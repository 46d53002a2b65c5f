#!/usr/bin/env bash
# The activation harness's run on a GPU machine: build both FlashInfer revisions for the GPU at
# hand, bit-check pristine against patched on every case of run.py's grid, time the serving
# shapes, and write activation.log, activation.json (rewritten after every case, so a run stopped
# at its limit keeps what it did) and activation.png to $OUT.
#
# From the repository root, with the bundle carried (`make gpu-bundles` makes it):
#   OUT=/some/dir tests/flashinfer/gpu/device_run.sh [BUNDLE_DIR]      (default work/activation-bundle)
# The bundle's stamp is checked against the carried patches/flashinfer first. BUILD_DIR (default
# a folder under TMPDIR) receives the libraries and their ptxas logs.
# Exit status is run.py's: 0 all good, 1 wrong results, 3 a shape slower than pristine or a goal
# missed; 2 no usable bundle, no GPU visible or no nvcc (activation.json's verdict says which),
# 124 run.py stopped at its limit. PYTHON (default python3) is the Python with the machine's torch.
# Deadline: DEADLINE_S (default 290) bounds the whole script: run.py gets what is left less
# RESERVE_S (default 20), and the decode probe and Nsight Compute only what run.py left them
# (at most 120 s and 150 s; skipped under 20 s, and on a machine run.py found unfit).
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
: "${OUT:?set OUT to the directory for the results}"
BUNDLE=${1:-work/activation-bundle}
BUILD_DIR=${BUILD_DIR:-${TMPDIR:-/tmp}/dist-activation-build}
DEADLINE=$((SECONDS + ${DEADLINE_S:-290}))
mkdir -p "$OUT" "$BUILD_DIR"
# within CAP: at most CAP seconds, and no later than the deadline less RESERVE_S (0: too late).
within() {
  local t=$((DEADLINE - SECONDS - ${2:-0}))
  [ "$t" -lt "$1" ] || t=$1
  [ "$t" -ge 20 ] || t=0
  echo "$t"
}
PYTHONPATH=build python3 -m distbuild.host.gpubundles check "$BUNDLE" 2>&1 | tee "$OUT/activation.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "device_run.sh: no usable bundle at $BUNDLE" >&2; exit 2; }
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "${PYTHON:-python3}" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
} >> "$OUT/activation.log"
run_s=$(within "${DEADLINE_S:-290}" "${RESERVE_S:-20}")
[ "$run_s" -gt 0 ] || { echo "device_run.sh: DEADLINE_S=${DEADLINE_S:-290} leaves run.py no time" >&2; exit 2; }
echo "run.py: up to $run_s s of the deadline's ${DEADLINE_S:-290} s" | tee -a "$OUT/activation.log"
PYTHONUNBUFFERED=1 timeout --kill-after=5 "$run_s" "${PYTHON:-python3}" tests/flashinfer/gpu/run.py \
  --bundle "$BUNDLE" --out "$BUILD_DIR" --jobs 2 --json "$OUT/activation.json" --png "$OUT/activation.png" 2>&1 \
  | tee -a "$OUT/activation.log"
rc=${PIPESTATUS[0]}
[ "$rc" != 124 ] || echo "run.py: stopped at its limit of $run_s s" | tee -a "$OUT/activation.log"
[ "$rc" != 2 ] || exit 2  # no GPU or no nvcc here: the probes below would only fail the same way
# Where the time goes at decode sizes (decode_probe.py), with the revision in ACTIVATION_PREVIOUS
# as a third where set; then the kernels alone under Nsight Compute, where the machine has it.
PREVIOUS=()
[ -z "${ACTIVATION_PREVIOUS:-}" ] || PREVIOUS=(--previous "$ACTIVATION_PREVIOUS")
probe=(tests/flashinfer/gpu/decode_probe.py --bundle "$BUNDLE" "${PREVIOUS[@]}" --out "$BUILD_DIR")
{
  probe_s=$(within 120 5)
  echo "=== decode probe: up to $probe_s s"
  [ "$probe_s" = 0 ] || PYTHONUNBUFFERED=1 timeout "$probe_s" "${PYTHON:-python3}" "${probe[@]}" \
    --json "$BUILD_DIR/decode-probe.json"
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  ncu_s=$(within 150 5)
  if [ "$ncu_s" = 0 ]; then
    echo "ncu: skipped, the deadline is near"
  elif [ -n "$NCU" ]; then
    timeout "$ncu_s" "$NCU" --metrics gpu__time_duration.sum -k regex:activationDeepSeek --csv \
      --log-file "$BUILD_DIR/decode-ncu.csv" "${PYTHON:-python3}" "${probe[@]}" --launch-only \
      --json "$BUILD_DIR/decode-ncu-order.json" > "$BUILD_DIR/decode-ncu.out" 2>&1 \
      && "${PYTHON:-python3}" tests/flashinfer/gpu/decode_probe.py --ncu-summary "$BUILD_DIR/decode-ncu.csv" \
        --json "$BUILD_DIR/decode-ncu-order.json" || echo "ncu: failed (decode-ncu.out in details)"
  else
    echo "ncu: not on this machine"
  fi
} 2>&1 | tee -a "$OUT/activation.log"
# The SASS of both libraries, for reading the dependent loads the PTX analysis counts.
if command -v cuobjdump > /dev/null; then
  for lib in "$BUILD_DIR"/libactivation_*.so; do
    [ -f "$lib" ] && cuobjdump -sass "$lib" > "${lib%.so}.sass" 2>&1
  done
fi
exit "$rc"
