// Forward kernels with bf16 input (residual and weights: bf16 or fp32; see run_fwd_for_input).
#include "ln_fwd_kernel.cuh"

namespace layer_norm {
void run_fwd_bf16(const FwdParams& params, cudaStream_t stream) {
  run_fwd_for_input<__nv_bfloat16>(params, stream);
}
}  // namespace layer_norm
