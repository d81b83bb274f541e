// Forward kernels with fp16 input (residual and weights: fp16 or fp32; see run_fwd_for_input).
#include "ln_fwd_kernel.cuh"

namespace layer_norm {
void run_fwd_fp16(const FwdParams& params, cudaStream_t stream) {
  run_fwd_for_input<__half>(params, stream);
}
}  // namespace layer_norm
