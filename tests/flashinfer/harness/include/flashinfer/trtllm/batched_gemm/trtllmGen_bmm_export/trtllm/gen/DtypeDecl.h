// Stand-in for the trtllm-gen export header of the same name, for the compile harness in
// tests/flashinfer (see activation_build.py). FlashInfer downloads the real header from its
// artifact store when it JIT-compiles the fused-MoE module; that store is not reachable in CI.
//
// The activation kernels (csrc/fused_moe/trtllm_backend/trtllm_fused_moe_dev_kernel.cu) reach
// this header through DevKernel.h and use only these enumerators, in host-side comparisons
// (which dtype to instantiate), and, from FlashInfer 0.7.4, dtypeGetNumBits in the finalize
// launcher (host code: the vector width of a dtype). The enumerators' values here are arbitrary;
// dtypeGetNumBits gives each dtype's real width. No device code depends on either. Anything else
// the file used from the real header would fail to compile against this one.
#pragma once

namespace batchedGemm::trtllm::gen {

enum class Dtype : int { Bfloat16, E2m1, E4m3, Fp16, Fp32 };

inline int dtypeGetNumBits(Dtype dtype) {
  switch (dtype) {
    case Dtype::E2m1: return 4;
    case Dtype::E4m3: return 8;
    case Dtype::Bfloat16:
    case Dtype::Fp16: return 16;
    case Dtype::Fp32: return 32;
  }
  return 0;
}

}  // namespace batchedGemm::trtllm::gen
