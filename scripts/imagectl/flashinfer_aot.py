"""Ahead-of-time build of FlashInfer's trtllm-gen fused-MoE module for sm_103a (build stage).

``python -m imagectl.flashinfer_aot --out DIR --status FILE`` with the patched
FlashInfer installed and ``FLASHINFER_CUDA_ARCH_LIST=10.3a``.

The module (``fused_moe_trtllm_sm100``: Blackwell, sm_103 included) includes
trtllm-gen export headers and a kernel list (``flashinferMetaInfo.h``) that
FlashInfer fetches from its artifact store, checked against ``checksums.txt``,
whose own sha256 FlashInfer pins in ``flashinfer/artifacts.py``. No PyPI
package carries FlashInfer 0.7.0.post1's batched-GEMM artifact (the newest
``flashinfer-cubin`` wheel, 0.6.13, carries an older one; see README.md), so
the only honest source is the store itself:

- store reachable and ``checksums.txt`` matching the pin: FlashInfer's own
  ``get_artifact`` fetches and verifies the headers, the module is compiled
  for the requested arch and copied to ``OUT/<module>/<module>.so``, the path
  ``flashinfer.jit.env.get_aot_path`` resolves; status ``built``;
- otherwise nothing is compiled; status ``missing``, with what could not be
  prefetched and what that means on the GPU node.

Either way the status file is written and the stage succeeds: the image
records the status (manifest, label) and its self-test reports it. A compile
failure with the headers present is an error (exit 1).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

MODULE = "fused_moe_trtllm_sm100"
PROBE_TIMEOUT_S = 20.0


def consequence(store: str) -> str:
    return (f"FlashInfer has no ahead-of-time {MODULE} in this image: on the GPU node it JIT-compiles the module at "
            f"first use of the trtllm-gen fused MoE (several minutes per arch with nvcc, which the image carries "
            f"through vLLM's dependencies) and downloads the export headers, flashinferMetaInfo.h and the "
            f"batched-GEMM cubins from {store}: the node needs network access to that store (or a FLASHINFER_CUBIN_DIR "
            f"filled from it, which this image does not carry).")


def probe(url: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[bytes | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read(), "ok"
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def needed_files(bmm_path: str, headers: list[str]) -> list[str]:
    include = f"{bmm_path.rstrip('/')}/include"
    return [f"{bmm_path.rstrip('/')}/checksums.txt", f"{include}/flashinferMetaInfo.h",
            *(f"{include}/trtllmGen_bmm_export/{h}" for h in headers)]


def write_status(path: Path, status: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(status, indent=1, sort_keys=True) + "\n")


def build(out: Path, status_file: Path) -> int:
    from flashinfer.artifacts import ArtifactPath, CheckSumHash
    from flashinfer.jit import cubin_loader
    from flashinfer.jit.fused_moe import BMM_EXPORT_HEADERS, gen_trtllm_gen_fused_moe_sm100_module

    arch_list = os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "")
    store = cubin_loader.FLASHINFER_CUBINS_REPOSITORY
    bmm_path = ArtifactPath.TRTLLM_GEN_BMM
    files = needed_files(bmm_path, list(BMM_EXPORT_HEADERS))
    status = {"module": MODULE, "cuda_arch_list": arch_list, "artifact_store": store, "artifact": bmm_path,
              "checksums_sha256": CheckSumHash.TRTLLM_GEN_BMM, "needs": files}
    out.mkdir(parents=True, exist_ok=True)
    checksums, why = probe(store.rstrip("/") + "/" + files[0])
    if checksums is not None and hashlib.sha256(checksums).hexdigest() != CheckSumHash.TRTLLM_GEN_BMM:
        checksums, why = None, "checksums.txt from the store does not match the sha256 FlashInfer pins"
    if checksums is None:
        status.update(status="missing", missing=files, reason=f"artifact store unreachable from the build: {why}",
                      consequence=consequence(store))
        write_status(status_file, status)
        print(f"flashinfer-aot: NOT BUILT: {MODULE} for {arch_list}: {status['reason']}", file=sys.stderr)
        print(f"flashinfer-aot: could not prefetch {len(files)} file(s): {', '.join(Path(f).name for f in files)}",
              file=sys.stderr)
        print(f"flashinfer-aot: on the GPU node: {status['consequence']}", file=sys.stderr)
        return 0
    spec = gen_trtllm_gen_fused_moe_sm100_module()   # fetches and verifies the headers (FlashInfer's checksums)
    spec.build(verbose=True)
    built = spec.get_library_path()
    dest = out / MODULE / f"{MODULE}.so"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, dest)
    status.update(status="built", so=f"{MODULE}/{MODULE}.so", sha256=hashlib.sha256(dest.read_bytes()).hexdigest(),
                  missing=[], note="the trtllm-gen batched-GEMM cubins are still fetched at first use unless "
                  "FLASHINFER_CUBIN_DIR is prefilled")
    write_status(status_file, status)
    print(f"flashinfer-aot: built {dest} for {arch_list}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="imagectl.flashinfer_aot", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--status", type=Path, required=True)
    args = p.parse_args(argv)
    return build(args.out, args.status)


if __name__ == "__main__":
    sys.exit(main())
