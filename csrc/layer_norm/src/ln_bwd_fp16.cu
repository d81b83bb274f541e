// Backward kernels with fp16 input (residual and weights: fp16 or fp32; see run_bwd_for_input).
#include "ln_bwd_kernel.cuh"

namespace layer_norm {
int run_bwd_fp16(const BwdParams& params, cudaStream_t stream, bool launch) {
  return run_bwd_for_input<__half>(params, stream, launch);
}
}  // namespace layer_norm
