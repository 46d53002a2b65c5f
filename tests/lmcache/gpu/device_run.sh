#!/usr/bin/env bash
# LMCache's gpu-marked tests on a GPU machine without a package index.
#
# From the repository root, with the bundle carried (make_bundle.py; README.md beside this file):
#   OUT=/some/dir tests/lmcache/gpu/device_run.sh [BUNDLE_DIR]      (default work/lmcache-gpu-bundle)
#
# Steps, each timed into $OUT/lmcache-gpu.log and $OUT/lmcache-gpu.json (rewritten after every
# step; the other files go to $DETAILS, default $OUT):
#   stamp    the bundle's SOURCES.json against the carried patches/lmcache (a stale bundle: exit 2)
#   detect   python/torch/CUDA/nvcc/ninja and the GPU's arch (TORCH_CUDA_ARCH_LIST from it)
#   deps     a venv over the machine's Python (its torch), the bundle's wheels it lacks (install_deps.py)
#   build    LMCache's extensions from the carried patched source, in place
#            (setup.py build_ext --inplace: lmcache.cuda_ops + the common C++ ones; MAX_JOBS=nproc)
#   test     pytest -m gpu on the gpu-marked tests/lmcache files, junit XML into $DETAILS
#   leaveout the 0010 stream-order proofs (V2 and V3 connectors) on the bundle's leave-out variant,
#            the series with 0010 less its stream wrapper (leaveout/PATCH names it): they must
#            fail with their fails_with, "paged KV differs" (strict xfail, tests/conftest.py)
# Deadlines: DEADLINE_S (default 540) bounds the whole script; the build gets what is left less
# the test steps' share, the test and leave-one-out steps split the rest, and the summary is
# written inside it. GPU_FREE: when set, the GPU steps wait until that file exists (another part
# has the GPU until then). MAX_JOBS: the build's parallel compiles (default nproc).
# Environment: PYTHON (default python3: the machine's torch), DIST_NO_GPU_EXT=1 for the CPU
# rehearsal (check_local.sh): the CUDA build is SKIPPED (NO_GPU_EXT=1, common C++ extensions
# only), no GPU is required, and the gpu tests are collected and skip for want of CUDA.
# Exit: 0 every selected test passed (rehearsal: collected and skipped), 1 a test failed,
# 2 the machine or the bundle is unfit (the log says which).
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
REPO=$PWD
: "${OUT:?set OUT to the directory for the results}"
BUNDLE=$(cd "${1:-work/lmcache-gpu-bundle}" 2>/dev/null && pwd) \
  || { echo "device_run.sh: no bundle at ${1:-work/lmcache-gpu-bundle} (tests/lmcache/gpu/make_bundle.py)" >&2; exit 2; }
PYTHON=${PYTHON:-python3}
REHEARSAL=${DIST_NO_GPU_EXT:-0}
W=${DIST_GPU_WORK:-${TMPDIR:-/tmp}/dist-lmcache-gpu}
DETAILS=${DETAILS:-$OUT}
DEADLINE=$((SECONDS + ${DEADLINE_S:-540}))
mkdir -p "$OUT" "$DETAILS"
LOG=$OUT/lmcache-gpu.log
STEPS=$DETAILS/steps.tsv
: > "$LOG"; : > "$STEPS"
# The JSON's verdict: "running" until the script ends, then what its exit status means.
VERDICT=running
log() { echo "$*" | tee -a "$LOG"; }
fail() { log "device_run.sh: $*"; VERDICT="unfit: $*"; summary; exit 2; }
left() { echo $((DEADLINE - SECONDS)); }
# limit SHARE_PERCENT RESERVE CAP: a step's time limit, SHARE_PERCENT of what is left once
# RESERVE seconds are kept for the steps after it, at most CAP.
limit() {
  local t=$(( ($(left) - $2) * $1 / 100 ))
  [ "$t" -lt "$3" ] || t=$3
  [ "$t" -gt 5 ] || t=5
  echo "$t"
}

step() {  # step NAME CMD...: run, time, record; the command's output goes to the log
  local name=$1; shift
  local t0=$SECONDS
  log "=== $name: $(date -u +%H:%M:%S)"
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - t0))" "$rc" >> "$STEPS"
  log "=== $name: rc=$rc in $((SECONDS - t0)) s, $(left) s left"
  summary > /dev/null
  return "$rc"
}

summary() {
  python3 - "$STEPS" "$DETAILS" "$REHEARSAL" "$OUT/lmcache-gpu.json" "$VERDICT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
steps_file, out, rehearsal, dest = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", Path(sys.argv[4])
steps = [dict(zip(("step", "seconds", "rc"), line.split("\t"))) for line in steps_file.read_text().splitlines()]
summary = {"verdict": sys.argv[5], "rehearsal_without_cuda": rehearsal, "steps": [{**s, "seconds": int(s["seconds"]), "rc": int(s["rc"])} for s in steps]}
for name in ("junit.xml", "junit-leaveout.xml"):
    path = out / name
    if path.is_file():
        cases = []
        for case in ET.parse(path).iter("testcase"):
            status = "passed"
            for kind in ("failure", "error", "skipped"):
                node = case.find(kind)
                if node is not None:
                    status = kind if kind != "skipped" else "skipped: " + (node.get("message") or "")
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "seconds": float(case.get("time", 0)), "status": status})
        summary[name] = cases
env = out / "env.json"
if env.is_file():
    summary["env"] = json.loads(env.read_text())
partial = dest.with_name(dest.name + ".partial")
partial.write_text(json.dumps(summary, indent=1) + "\n")
partial.replace(dest)
print("steps:", ", ".join(f"{s['step']} {s['seconds']} s (rc {s['rc']})" for s in summary["steps"]))
EOF
}

# ---- detect -------------------------------------------------------------------------------
detect() {
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi: none"
  (nvcc --version 2>&1 | tail -2) || echo "nvcc: none"
  echo "ninja: $(ninja --version 2>&1 || echo none)  cores: $(nproc)"
  "$PYTHON" - "$DETAILS/env.json" <<'EOF'
import json, os, shutil, site, sys, sysconfig
from pathlib import Path
env = {"python": sys.version.split()[0], "executable": sys.executable, "in_venv": sys.prefix != sys.base_prefix,
       "site_packages": site.getsitepackages(), "python_h": (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file(),
       "nvcc": shutil.which("nvcc"), "ninja": shutil.which("ninja"), "cores": os.cpu_count()}
try:
    import torch
    env.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
               cxx11_abi=int(torch._C._GLIBCXX_USE_CXX11_ABI))
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        env.update(gpu=torch.cuda.get_device_name(0), capability=f"{major}.{minor}")
except ImportError as exc:
    env["torch_error"] = str(exc)
Path(sys.argv[1]).write_text(json.dumps(env, indent=1) + "\n")
print(json.dumps(env))
EOF
}
step stamp env PYTHONPATH="$REPO/build" python3 -m distbuild.host.gpubundles check "$BUNDLE" \
  || fail "the bundle at $BUNDLE is not this tree's (above): make gpu-bundles"
step detect detect || fail "cannot run $PYTHON"
envget() { "$PYTHON" -c "import json,sys; v=json.load(open('$DETAILS/env.json')).get('$1'); print('' if v is None else v)"; }
[ -n "$(envget torch)" ] || fail "$PYTHON has no torch ($(envget torch_error)); set PYTHON to the machine's torch Python"
[ "$(envget python_h)" = True ] || fail "$PYTHON has no Python.h: LMCache's extensions cannot be built with it"
if [ "$REHEARSAL" = 1 ]; then
  log "REHEARSAL (DIST_NO_GPU_EXT=1): no GPU required, the CUDA extension is NOT built, gpu tests skip"
else
  [ "$(envget cuda_available)" = True ] || fail "torch $(envget torch) sees no CUDA device"
  [ -n "$(envget nvcc)" ] || fail "no nvcc on PATH: lmcache.cuda_ops cannot be built"
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(envget capability)}
  log "GPU $(envget gpu), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
fi

# ---- deps -------------------------------------------------------------------------------
deps() {
  rm -rf "$W" && mkdir -p "$W/tmp" || return 2
  # The venv sees exactly what $PYTHON sees (its torch). Made from a plain installation,
  # --system-site-packages does that. Made from a venv's Python (the GPU machine's python3 is
  # /opt/torch/.venv's), "system" would mean the base installation, not that venv, so torch
  # would be missing: there the parent's site directories go on the new venv's path through
  # a .pth file instead. --without-pip: the parent's pip serves, through the same path.
  local in_venv site made
  in_venv=$("$PYTHON" -c 'import sys; print(int(sys.prefix != sys.base_prefix))') || return 2
  if [ "$in_venv" = 1 ]; then
    "$PYTHON" -m venv --without-pip "$W/venv"; made=$?
  else
    "$PYTHON" -m venv --without-pip --system-site-packages "$W/venv"; made=$?
  fi
  if [ "$made" != 0 ]; then
    # No venv module: the wheels go into a folder on PYTHONPATH, ahead of the machine's own.
    echo "python -m venv failed (rc $made): FALLBACK, installing into $W/site on PYTHONPATH instead"
    mkdir -p "$W/site" && touch "$W/fallback-target"
    PYTHONPATH="$W/site" "$PYTHON" "$REPO/tests/lmcache/gpu/install_deps.py" --bundle "$BUNDLE" --python "$PYTHON" \
      --target "$W/site" --report "$W/deps.json"
    return
  fi
  site=$("$W/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 2
  if [ "$in_venv" = 1 ]; then
    "$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_dist_parent_site.pth" || return 2
    echo "parent venv's site directories on the new venv's path: $(tr '\n' ' ' < "$site/_dist_parent_site.pth")"
  fi
  "$W/venv/bin/python" -c 'import torch, pip; print("venv sees torch", torch.__version__, "and pip", pip.__version__)' || return 2
  "$W/venv/bin/python" "$REPO/tests/lmcache/gpu/install_deps.py" --bundle "$BUNDLE" --python "$W/venv/bin/python" \
    --report "$W/deps.json"
}
step deps deps || fail "the test dependencies could not be installed (see above)"
VPY=$W/venv/bin/python
SITE=
if [ -f "$W/fallback-target" ]; then VPY=$PYTHON; SITE=:$W/site; fi

# ---- build ------------------------------------------------------------------------------
build() {
  # All that is left but what the GPU steps after it need (GPU_STEPS_S), at most BUILD_TIMEOUT_S.
  local build_s
  build_s=$(limit 100 "${GPU_STEPS_S:-150}" "${BUILD_TIMEOUT_S:-480}")
  echo "build limit: $build_s s (MAX_JOBS=${MAX_JOBS:-$(nproc)})"
  mkdir -p "$W/lmcache" && tar -xzf "$BUNDLE/lmcache-src.tar.gz" -C "$W/lmcache" || return 2
  local abi
  abi=$(envget cxx11_abi)
  if [ "$REHEARSAL" = 1 ]; then
    echo "CUDA build SKIPPED (DIST_NO_GPU_EXT=1): building only LMCache's common C++ extensions"
    export NO_GPU_EXT=1
  else
    export BUILD_WITH_CUDA=1
  fi
  # The archive has no git metadata, which setuptools-scm (where the Python has it) would
  # read the version from: give it the stamped release.
  local version
  version=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["series"]["lmcache"]["version"])' \
    "$BUNDLE/SOURCES.json") || return 2
  (cd "$W/lmcache" && env ${SITE:+PYTHONPATH=${SITE#:}} ENABLE_CXX11_ABI="$abi" MAX_JOBS="${MAX_JOBS:-$(nproc)}" NVCC_THREADS=1 \
     SETUPTOOLS_SCM_PRETEND_VERSION="$version" SETUPTOOLS_SCM_PRETEND_VERSION_FOR_LMCACHE="$version" \
     VCS_VERSIONING_PRETEND_VERSION_FOR_LMCACHE="$version" \
     timeout "$build_s" "$VPY" setup.py build_ext --inplace > "$DETAILS/build.log" 2>&1)
  local rc=$?
  tail -5 "$DETAILS/build.log"
  # Per compile unit (ninja's log: start and end in ms), slowest first: the next estimate's data.
  find "$W/lmcache/build" -name .ninja_log -exec awk -F'\t' 'NR > 1 {printf "%6.1f s  %s\n", ($2 - $1) / 1000, $4}' {} \; \
    | sort -rn | head -15
  [ "$rc" = 0 ] || { echo "build failed (rc $rc, limit $build_s s): build.log"; return 2; }
  local mods="lmcache.lmcache_native lmcache.lmcache_redis lmcache.lmcache_fs"
  [ "$REHEARSAL" = 1 ] || mods="$mods lmcache.cuda_ops"
  (cd "$W" && PYTHONPATH="$W/lmcache$SITE" "$VPY" -c "
import importlib, sys
for m in sys.argv[1:]:
    print('imports', m, importlib.import_module(m).__file__)" $mods)
}
step build build || fail "LMCache's extensions did not build or import (build.log)"

# ---- test -------------------------------------------------------------------------------
# ---- the GPU: another part may hold it until $GPU_FREE exists -----------------------------
wait_gpu() {
  [ -n "${GPU_FREE:-}" ] || return 0
  echo "waiting for $GPU_FREE"
  while [ ! -e "$GPU_FREE" ]; do
    [ "$(left)" -gt 60 ] || { echo "the GPU was not free with a minute left"; return 1; }
    sleep 1
  done
}
step gpu-wait wait_gpu || fail "the GPU did not become free in time"

mapfile -t FILES < <(grep -l 'pytest.mark.gpu' tests/lmcache/test_*.py)
log "gpu-marked LMCache test files: ${FILES[*]}"
PYTEST=(env PYTHONPATH="$REPO:$W/lmcache$SITE" PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 TMPDIR="$W/tmp"
        timeout "$(limit 65 10 "${TEST_TIMEOUT_S:-420}")" "$VPY" -m pytest -p no:cacheprovider
        -p tests.lmcache.gpu.device_plugin -m gpu -q -rA)
[ "$REHEARSAL" = 1 ] || PYTEST+=(--device-require-gpu)
step test "${PYTEST[@]}" --junitxml "$DETAILS/junit.xml" "${FILES[@]}" < /dev/null
test_rc=$?

# ---- leave-one-out: the 0010 proof without 0010 --------------------------------------------
LEAVEOUT_GPU=(--device-require-gpu)
[ "$REHEARSAL" != 1 ] || LEAVEOUT_GPU=()
if [ -d "$BUNDLE/leaveout" ]; then
  leaveout() {
    local patch
    patch=$(cat "$BUNDLE/leaveout/PATCH")
    # The built package (its .so files: the variant differs in Python files only) with the
    # variant's Python files over it and the files it lacks removed.
    rm -rf "$W/without" && mkdir -p "$W/without" && cp -a "$W/lmcache/lmcache" "$W/without/" || return 2
    [ ! -d "$BUNDLE/leaveout/lmcache" ] || cp -a "$BUNDLE/leaveout/lmcache/." "$W/without/lmcache/" || return 2
    while read -r rel; do [ -z "$rel" ] || rm -f "$W/without/$rel"; done < "$BUNDLE/leaveout/DELETE"
    echo "without $patch: $(find "$BUNDLE/leaveout/lmcache" -name '*.py' | wc -l) files replaced, $(grep -c . "$BUNDLE/leaveout/DELETE") removed"
    env PYTHONPATH="$REPO:$W/without$SITE" DIST_LMCACHE_TREE="without:$patch" PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 \
      TMPDIR="$W/tmp" timeout "$(limit 100 10 "${TEST_TIMEOUT_S:-420}")" "$VPY" -m pytest -p no:cacheprovider \
      -p tests.lmcache.gpu.device_plugin "${LEAVEOUT_GPU[@]}" -m gpu -q -rA --junitxml "$DETAILS/junit-leaveout.xml" "${FILES[@]}"
  }
  step leaveout leaveout < /dev/null || test_rc=1
fi
if [ "$test_rc" != 0 ]; then
  VERDICT="a test failed"
elif [ "$REHEARSAL" = 1 ]; then
  VERDICT="rehearsal without CUDA (DIST_NO_GPU_EXT=1): CUDA device visible: $(envget cuda_available); deps, the common extensions and collection passed, the gpu tests skipped"
else
  VERDICT=passed
fi
summary
[ "$test_rc" = 0 ] || exit 1
exit 0
