// Empty stand-in for the cuBLAS header cublas_v2.h, for the compile harness in tests/flashinfer.
// flashinfer/trtllm/common/cudaUtils.h includes it but the fused-MoE activation code uses
// nothing from it; the pinned nvcc wheels carry no cuBLAS headers. This directory is searched
// after the CUDA toolkit's include directory, so a full toolkit's real header wins.
#pragma once
