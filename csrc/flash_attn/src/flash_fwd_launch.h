// The launch of the forward kernel. Included only by the generated instantiation units (one per
// dtype x head dim x dropout x mask), which compile in parallel.
#pragma once

#include "cuda_check.h"
#include "flash.h"
#include "flash_fwd_kernel.h"
#include "kernel_traits.h"
#include "tile_sizes.h"

namespace flash {

template <typename Tile, typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
void launch_fwd(AttentionParams &params, cudaStream_t stream) {
    using Traits = ForwardTraits<kHeadDim, Tile::kBlockM, Tile::kBlockN, Tile::kNWarps, Element>;
    constexpr int kSmemSize = Traits::kSmemSize;
    auto kernel = &flash_fwd_kernel<Traits, Is_dropout, Is_masked>;
    if (kSmemSize >= 48 * 1024) {
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemSize),
                   "cudaFuncSetAttribute(max dynamic shared memory) of the forward kernel");
    }
    // z: heads fastest, then the split-KV splits (fwd_block_range.h).
    const dim3 grid(ceil_div(params.seqlen_q, Traits::kBlockM), params.batch, params.heads * params.num_splits);
    kernel<<<grid, Traits::kNThreads, kSmemSize, stream>>>(params);
    check_cuda(cudaGetLastError(), "launch of the forward kernel");
}

template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
void run_mha_fwd_(AttentionParams &params, cudaStream_t stream) {
    if constexpr (takes_decode_tile(0, Is_dropout, Is_masked)) {
        if (takes_decode_tile(params.seqlen_q, Is_dropout, Is_masked)) {
            return launch_fwd<DecodeTile<kHeadDim>, Element, kHeadDim, Is_dropout, Is_masked>(params, stream);
        }
    }
    launch_fwd<ForwardTile<kHeadDim, Is_dropout>, Element, kHeadDim, Is_dropout, Is_masked>(params, stream);
}

}  // namespace flash
