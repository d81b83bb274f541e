// Backward kernels with fp32 input (residual fp32; weights fp32 or fp16; see run_bwd_for_input).
#include "ln_bwd_kernel.cuh"

namespace layer_norm {
int run_bwd_fp32(const BwdParams& params, cudaStream_t stream, bool launch) {
  return run_bwd_for_input<float>(params, stream, launch);
}
}  // namespace layer_norm
