// Plain parameter structs shared by the torch binding (ln_api.cpp) and the kernels (src/*.cu).
// Nothing here depends on torch, so the kernel translation units compile with nvcc alone.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace layer_norm {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Largest hidden size and the vector width every row is split into (8 elements = one 16-byte
// load of a 2-byte type), hence "hidden size a multiple of 8, at most 8192".
constexpr int kMaxCols = 8192;
constexpr int kEltsPerVec = 8;

// PyTorch's Philox state, unpacked into plain fields. Under CUDA-graph capture the seed and the
// offset live in device memory (read in the kernel) so that replays draw fresh numbers.
struct PhiloxArgs {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  uint64_t offset_intragraph = 0;
  bool captured = false;
};

// Forward of z = LN(dropout(x0 * rowscale * colscale) [+ dropout(x1)] + residual) * gamma + beta,
// and z1 = LN(...) * gamma1 + beta1 for the parallel-residual form. Row r of x (and of residual,
// mu, rs) reads x0 row x0_subset[r] - 1 and writes z row z_subset[r] - 1 when the subsets are
// given (0 means: no such row), else row r for both.
struct FwdParams {
  int64_t rows = 0;  // rows of x / residual
  int cols = 0;
  DType itype = DType::kFloat32, rtype = DType::kFloat32, wtype = DType::kFloat32;

  const void* x0 = nullptr;
  const void* x1 = nullptr;
  const void* residual = nullptr;
  const void* gamma = nullptr;
  const void* beta = nullptr;
  const void* gamma1 = nullptr;
  const void* beta1 = nullptr;
  const void* rowscale = nullptr;  // input dtype, one per row
  const void* colscale = nullptr;  // weight dtype, one per column
  const int32_t* x0_subset = nullptr;
  const int32_t* z_subset = nullptr;

  void* z = nullptr;
  void* z1 = nullptr;
  void* x = nullptr;         // pre-norm sum in the residual dtype; nullptr: not stored
  uint8_t* dmask = nullptr;  // keep mask of x0 (x0's rows); nullptr: no dropout
  uint8_t* dmask1 = nullptr;
  float* mu = nullptr;
  float* rs = nullptr;

  float epsilon = 0.f;
  float dropout_scale = 1.f;    // 1 / (1 - p)
  uint32_t keep_threshold = 0;  // keep an element when its 32-bit random draw is below this
  float rowscale_const = 1.f;   // scale of x0 in the subset form
  bool is_rms_norm = false;
  PhiloxArgs philox;
  int vecs_per_thread = 0;  // 0: the built-in choice; 1, 2, 4: a tuning override
};

// Backward. dz rows follow z_subset, dx0 rows follow x0_subset, as in the forward.
struct BwdParams {
  int64_t rows = 0;
  int cols = 0;
  DType itype = DType::kFloat32, rtype = DType::kFloat32, wtype = DType::kFloat32;
  int num_sms = 1;

  const void* dz = nullptr;
  const void* dz1 = nullptr;
  const void* dx = nullptr;  // gradient of the pre-norm output (prenorm); residual dtype
  const void* x = nullptr;   // saved pre-norm sum; residual dtype
  const void* x0 = nullptr;  // needed for the gradient of colscale only
  const uint8_t* dmask = nullptr;
  const uint8_t* dmask1 = nullptr;
  const float* mu = nullptr;
  const float* rs = nullptr;
  const void* gamma = nullptr;
  const void* gamma1 = nullptr;
  const void* rowscale = nullptr;
  const void* colscale = nullptr;
  const int32_t* x0_subset = nullptr;
  const int32_t* z_subset = nullptr;

  void* dx0 = nullptr;
  void* dx1 = nullptr;
  void* dresidual = nullptr;  // residual dtype; nullptr: no residual input
  // Per-part column sums (fp32, [num_parts, cols]) and their totals (weight dtype).
  float* dgamma_part = nullptr;
  float* dbeta_part = nullptr;
  float* dgamma1_part = nullptr;
  float* dbeta1_part = nullptr;
  float* dcolscale_part = nullptr;
  void* dgamma = nullptr;
  void* dbeta = nullptr;
  void* dgamma1 = nullptr;
  void* dbeta1 = nullptr;
  void* dcolscale = nullptr;

  float dropout_scale = 1.f;
  float rowscale_const = 1.f;
  bool is_rms_norm = false;
  int vecs_per_thread = 0;  // 0: the built-in choice; 1, 2: a tuning override
};

// One definition per input dtype (src/ln_{fwd,bwd}_<dtype>.cu), each covering the residual dtypes
// {input, fp32} and the weight dtypes {fp32, the input dtype for fp16 / bf16, fp16 for fp32}.
void run_fwd_fp32(const FwdParams& params, cudaStream_t stream);
void run_fwd_fp16(const FwdParams& params, cudaStream_t stream);
void run_fwd_bf16(const FwdParams& params, cudaStream_t stream);
// With launch == false: only returns the number of partial-sum rows the launch will write, so the
// caller can size the *_part buffers. With launch == true: runs and returns the same number.
int run_bwd_fp32(const BwdParams& params, cudaStream_t stream, bool launch);
int run_bwd_fp16(const BwdParams& params, cudaStream_t stream, bool launch);
int run_bwd_bf16(const BwdParams& params, cudaStream_t stream, bool launch);

inline void run_fwd(const FwdParams& params, cudaStream_t stream) {
  switch (params.itype) {
    case DType::kFloat32: return run_fwd_fp32(params, stream);
    case DType::kFloat16: return run_fwd_fp16(params, stream);
    case DType::kBFloat16: return run_fwd_bf16(params, stream);
  }
}

inline int run_bwd(const BwdParams& params, cudaStream_t stream, bool launch) {
  switch (params.itype) {
    case DType::kFloat32: return run_bwd_fp32(params, stream, launch);
    case DType::kFloat16: return run_bwd_fp16(params, stream, launch);
    case DType::kBFloat16: return run_bwd_bf16(params, stream, launch);
  }
  return 0;
}

}  // namespace layer_norm
