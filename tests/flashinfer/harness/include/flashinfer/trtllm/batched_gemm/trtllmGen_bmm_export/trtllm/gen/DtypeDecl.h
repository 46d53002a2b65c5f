// Stand-in for the trtllm-gen export header of the same name, for the compile harness in
// tests/flashinfer (see activation_build.py). FlashInfer downloads the real header from its
// artifact store when it JIT-compiles the fused-MoE module; that store is not reachable in CI.
//
// The activation kernels (csrc/fused_moe/trtllm_backend/trtllm_fused_moe_dev_kernel.cu) reach
// this header through DevKernel.h and use only these enumerators, in host-side comparisons
// (which dtype to instantiate). Their values here are arbitrary; no device code depends on them.
// Anything else the file used from the real header would fail to compile against this one.
#pragma once

namespace batchedGemm::trtllm::gen {

enum class Dtype : int { Bfloat16, E2m1, E4m3, Fp16, Fp32 };

}  // namespace batchedGemm::trtllm::gen
