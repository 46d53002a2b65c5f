// GPU harness for FlashInfer's fused-MoE activation (see run.py next to this file).
//
// Built once per FlashInfer revision into its own shared library: DIST_ACTIVATION_SOURCE names
// that revision's trtllm_fused_moe_dev_kernel.cu, cut after `namespace activation`
// (activation_build.activation_part). The kernels and moe::dev::activation::run are that
// revision's code, unmodified; this file only exposes run() through a C ABI for ctypes.

#include <cuda_runtime.h>

#include <cstdio>
#include <exception>
#include <type_traits>
#include <utility>

#include DIST_ACTIVATION_SOURCE

namespace {

namespace act = moe::dev::activation;
namespace tg = batchedGemm::trtllm::gen;

// Data::ctaIdxXyToMnLimit exists from the patched revision on.
template <typename D, typename = void>
struct HasMnLimit : std::false_type {};
template <typename D>
struct HasMnLimit<D, std::void_t<decltype(std::declval<D&>().ctaIdxXyToMnLimit)>>
    : std::true_type {};

// Data::maxNumCtasInBatchDim (the MN-limit array's length) exists from the decode-latency
// revision of the patch on; the first patched revision walked up to the total instead.
template <typename D, typename = void>
struct HasMaxNumCtas : std::false_type {};
template <typename D>
struct HasMaxNumCtas<D, std::void_t<decltype(std::declval<D&>().maxNumCtasInBatchDim)>>
    : std::true_type {};

template <typename D>
void setMnLimit(D& data, int32_t const* mnLimit, int maxNumCtasInBatchDim) {
  if constexpr (HasMnLimit<D>::value) {
    data.ctaIdxXyToMnLimit = mnLimit;
  }
  if constexpr (HasMaxNumCtas<D>::value) {
    data.maxNumCtasInBatchDim = maxNumCtasInBatchDim;
  }
}

}  // namespace

extern "C" {

// 1 if this revision's activation::Data takes the routing's MN limits.
int dist_activation_has_mn_limit() { return HasMnLimit<act::Data>::value ? 1 : 0; }

// 1 if it also takes the MN-limit array's length (maxNumCtasInBatchDim).
int dist_activation_has_max_num_ctas() { return HasMaxNumCtas<act::Data>::value ? 1 : 0; }

// dtype: 0 = E4m3, 1 = Bfloat16, 2 = Fp16. Pointers are device pointers; null optional pointers
// keep their defaults. Returns 0, or 1 with a message in err (a FLASHINFER_CHECK), or 2 with
// the CUDA error of the launch.
int dist_activation_run(int dtype, int useDeepSeekFp8, int usePdl, void* in, void* out,
                        float* inDqSfs, float* outDqSfs, int innerDim, int numTokens, int topK,
                        int32_t* expandedIdxToPermutedIdx, int32_t const* totalNumPaddedTokens,
                        float const* alpha, float const* beta, float const* clampLimit,
                        int32_t const* ctaIdxXyToBatchIdx, int tileTokensDim,
                        int32_t const* ctaIdxXyToMnLimit, int maxNumCtasInBatchDim, void* stream,
                        char* err, int errLen) {
  act::Data data;
  data.mDtypeElt = dtype == 0 ? tg::Dtype::E4m3 : dtype == 1 ? tg::Dtype::Bfloat16 : tg::Dtype::Fp16;
  data.mUsePdl = usePdl != 0;
  data.mUseDeepSeekFp8 = useDeepSeekFp8 != 0;
  data.inPtr = in;
  data.outPtr = out;
  data.inDqSfsPtr = inDqSfs;
  data.outDqSfsPtr = outDqSfs;
  data.innerDim = innerDim;
  data.numTokens = numTokens;
  data.topK = topK;
  data.expandedIdxToPermutedIdx = expandedIdxToPermutedIdx;
  data.totalNumPaddedTokens = totalNumPaddedTokens;
  data.gatedActAlphaPtr = alpha;
  data.gatedActBetaPtr = beta;
  data.gatedActClampLimitPtr = clampLimit;
  data.ctaIdxXyToBatchIdx = ctaIdxXyToBatchIdx;
  data.tileTokensDim = tileTokensDim;
  setMnLimit(data, ctaIdxXyToMnLimit, maxNumCtasInBatchDim);
  try {
    act::run(data, stream);
  } catch (std::exception const& e) {
    std::snprintf(err, errLen, "%s", e.what());
    return 1;
  }
  cudaError_t const status = cudaGetLastError();
  if (status != cudaSuccess) {
    std::snprintf(err, errLen, "%s", cudaGetErrorString(status));
    return 2;
  }
  return 0;
}

}  // extern "C"
