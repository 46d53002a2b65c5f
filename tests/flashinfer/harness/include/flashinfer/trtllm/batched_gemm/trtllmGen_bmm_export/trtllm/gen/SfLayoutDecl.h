// Stand-in for the trtllm-gen export header of the same name, for the compile harness in
// tests/flashinfer (see DtypeDecl.h next to it and activation_build.py).
//
// trtllm_fused_moe_dev_kernel.cu uses only these enumerators, as template arguments of the
// scale-factor layout conversion (namespace convertsf); the activation code does not use them.
#pragma once

namespace batchedGemm::trtllm::gen {

enum class SfLayout : int { Linear, R128c4, R8c4, R8c16 };

}  // namespace batchedGemm::trtllm::gen
