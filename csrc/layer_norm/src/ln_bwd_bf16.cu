// Backward kernels with bf16 input (residual and weights: bf16 or fp32; see run_bwd_for_input).
#include "ln_bwd_kernel.cuh"

namespace layer_norm {
int run_bwd_bf16(const BwdParams& params, cudaStream_t stream, bool launch) {
  return run_bwd_for_input<__nv_bfloat16>(params, stream, launch);
}
}  // namespace layer_norm
