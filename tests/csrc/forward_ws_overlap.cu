// Instantiates the warp-specialised forward's overlapped kernels (d128 unmasked, d64 masked) for
// test_forward_ws_overlap.py, which reads their SASS.
#include <cutlass/numeric_types.h>

#include "flash_fwd_ws_kernel.h"

using D128 = flash::ForwardWs<128, cutlass::bfloat16_t, 2, 128>;
using D64Wide = flash::ForwardWs<64, cutlass::bfloat16_t, 3, 128>;

void *overlapped_forward_kernels[] = {
    reinterpret_cast<void *>(&flash::flash_fwd_ws_kernel<D128, false, true>),
    reinterpret_cast<void *>(&flash::flash_fwd_ws_kernel<D64Wide, true, true>),
};
