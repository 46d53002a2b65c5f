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
# missed; 2 no usable bundle. PYTHON (default python3) is the Python with the machine's torch.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
: "${OUT:?set OUT to the directory for the results}"
BUNDLE=${1:-work/activation-bundle}
BUILD_DIR=${BUILD_DIR:-${TMPDIR:-/tmp}/dist-activation-build}
mkdir -p "$OUT" "$BUILD_DIR"
PYTHONPATH=build python3 -m distbuild.host.gpubundles check "$BUNDLE" 2>&1 | tee "$OUT/activation.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "device_run.sh: no usable bundle at $BUNDLE" >&2; exit 2; }
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "${PYTHON:-python3}" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
} >> "$OUT/activation.log"
PYTHONUNBUFFERED=1 "${PYTHON:-python3}" tests/flashinfer/gpu/run.py --bundle "$BUNDLE" --out "$BUILD_DIR" \
  --jobs 2 --json "$OUT/activation.json" --png "$OUT/activation.png" 2>&1 | tee -a "$OUT/activation.log"
rc=${PIPESTATUS[0]}
# Where the time goes at decode sizes (decode_probe.py), with the revision in ACTIVATION_PREVIOUS
# as a third where set; then the kernels alone under Nsight Compute, where the machine has it.
PREVIOUS=()
[ -z "${ACTIVATION_PREVIOUS:-}" ] || PREVIOUS=(--previous "$ACTIVATION_PREVIOUS")
probe=(tests/flashinfer/gpu/decode_probe.py --bundle "$BUNDLE" "${PREVIOUS[@]}" --out "$BUILD_DIR")
{
  echo "=== decode probe"
  PYTHONUNBUFFERED=1 timeout 120 "${PYTHON:-python3}" "${probe[@]}" --json "$BUILD_DIR/decode-probe.json"
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -n "$NCU" ]; then
    timeout 150 "$NCU" --metrics gpu__time_duration.sum -k regex:activationDeepSeek --csv \
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
