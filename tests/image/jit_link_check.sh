#!/bin/bash
# Run inside the serving image (tests/image/test_runtime_image.py): FlashInfer's own JIT builds one
# real module for sm_103a with the image's toolchain, then the same build with lib64/stubs hidden.
# Prints one JSON object on the last line. The image's user writes only under /out.
set -u
export FLASHINFER_WORKSPACE_BASE=/out/ws FLASHINFER_CUDA_ARCH_LIST=10.3a MAX_JOBS=2
python3 - <<'PY' > /out/build.json 2> /out/build.err
import json
from flashinfer.jit.dsv3_optimizations import gen_concat_mla_module
spec = gen_concat_mla_module()
out = {"ninja": str(spec.ninja_path), "lib": str(spec.jit_library_path)}
try:
    spec.build(verbose=False)
    out["built"] = True
except Exception as exc:   # the test asserts on the message
    out["built"], out["error"] = False, str(exc)[-3000:]
print(json.dumps(out))
PY
lib="$(python3 -c 'import json; print(json.load(open("/out/build.json"))["lib"])')"
ninja_file="$(python3 -c 'import json; print(json.load(open("/out/build.json"))["ninja"])')"
stub=/opt/cuda/lib64/stubs/libcuda.so
stub_soname="$(readelf -d "$stub" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')"
stub_syms="$(nm -D --defined-only "$stub" 2>/dev/null | awk '{print $3}' | sort -u)"
needed="$(readelf -d "$lib" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
elf="$(cuobjdump --list-elf "$lib" 2>&1 | tr '\n' ' ')"
lib_undef="$(nm -D --undefined-only "$lib" 2>/dev/null | awk '{print $2}' | grep -E '^cu[A-Z]' | sort -u | tr '\n' ' ')"
# Every CUDA driver symbol the image's prebuilt CUDA objects leave to libcuda must be in the stub
# (cuFile* is libcufile's, not the driver's).
site=/opt/venv/lib/python3.11/site-packages
used="$(find "$site/flashinfer" "$site/vllm" "$site/lmcache" "$site/torch/lib" -name '*.so*' -type f 2>/dev/null \
        | xargs -r nm -D --undefined-only 2>/dev/null | awk '{print $2}' | sed 's/@.*//' | grep -E '^cu[A-Z][A-Za-z0-9_]*$' | grep -v '^cuFile' | sort -u)"
used_count="$(printf '%s\n' $used | grep -c . || true)"
missing="$(comm -23 <(printf '%s\n' $used) <(printf '%s\n' $stub_syms) | tr '\n' ' ')"
loader="$(ldconfig -p | grep -c 'libcuda\.so' || true)"
# The same module with the stub hidden: a CUDA home that is /opt/cuda without lib64/stubs.
nostub=/out/cuda-nostub
mkdir -p "$nostub/lib"
for e in /opt/cuda/*; do case "$(basename "$e")" in lib|lib64) ;; *) ln -s "$e" "$nostub/$(basename "$e")";; esac; done
for e in /opt/cuda/lib/*; do [ "$(basename "$e")" = stubs ] || ln -s "$e" "$nostub/lib/$(basename "$e")"; done
ln -s lib "$nostub/lib64"
sed "s|^cuda_home = .*|cuda_home = $nostub|" "$ninja_file" > /out/nostub.ninja
rm -f "$lib"
nostub_out="$(cd "$(dirname "$ninja_file")" && ninja -f /out/nostub.ninja 2>&1 | tail -5)"
python3 - "$stub_soname" "$needed" "$elf" "$lib_undef" "$missing" "$used_count" "$loader" "$nostub_out" <<'PY'
import json, sys
build = json.load(open("/out/build.json"))
keys = ("stub_soname", "needed", "elf", "lib_undefined_cu", "stub_missing", "driver_symbols_used", "loader_libcuda",
        "nostub")
print(json.dumps({**build, "ninja_text": open(build["ninja"]).read(), **dict(zip(keys, sys.argv[1:]))}))
PY
