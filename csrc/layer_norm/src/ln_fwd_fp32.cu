// Forward kernels with fp32 input (residual fp32; weights fp32 or fp16; see run_fwd_for_input).
#include "ln_fwd_kernel.cuh"

namespace layer_norm {
void run_fwd_fp32(const FwdParams& params, cudaStream_t stream) {
  run_fwd_for_input<float>(params, stream);
}
}  // namespace layer_norm
