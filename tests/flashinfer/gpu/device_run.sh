#!/usr/bin/env bash
# The activation harness's one run on a GPU machine (issue 19): build both FlashInfer revisions
# for the GPU at hand, bit-check pristine against patched on every case of run.py's grid (124),
# time the serving shapes (27), and write the log, the JSON and the PNG to $OUT.
#
# From the repository root, with the bundle carried (see README.md, "Running it"):
#   OUT=/some/dir tests/flashinfer/gpu/device_run.sh [BUNDLE_DIR]      (default work/activation-bundle)
# Exit status is run.py's: 0 all good, 1 wrong results, 3 a shape slower than pristine or a goal missed.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
: "${OUT:?set OUT to the directory for the results}"
BUNDLE=${1:-work/activation-bundle}
[ -f "$BUNDLE/patched/csrc/fused_moe/trtllm_backend/trtllm_fused_moe_dev_kernel.cu" ] \
  || { echo "device_run.sh: no bundle at $BUNDLE (run.py --make-bundle)" >&2; exit 2; }
mkdir -p "$OUT"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
} > "$OUT/activation.log"
python3 tests/flashinfer/gpu/run.py --bundle "$BUNDLE" --out "${TMPDIR:-/tmp}/dist-activation-build" \
  --jobs 2 --json "$OUT/activation.json" --png "$OUT/activation.png" 2>&1 | tee -a "$OUT/activation.log"
exit "${PIPESTATUS[0]}"
