// The launch of the backward: softmax_d (which also zeroes dq_accum), the key-block kernel, and
// the dq conversion. Included only by the generated instantiation units (one per dtype x head dim
// x dropout x mask).
#pragma once

#include "cuda_check.h"
#include "flash.h"
#include "flash_bwd_kernel.h"
#include "kernel_traits.h"
#include "tile_sizes.h"

namespace flash {

constexpr int kMaxGridY = 65535;  // CUDA's limit on gridDim.y: the kernel strides past it

template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
void run_mha_bwd_(AttentionParams &params, cudaStream_t stream) {
    using Tile = BackwardTile<kHeadDim>;
    using Traits = BackwardTraits<kHeadDim, Tile::kBlockM, Tile::kBlockN, Tile::kNWarps, Tile::kWarpsMSdP,
                                  Tile::kWarpsNdKV, Tile::kWarpsMdQ, Element>;
    const int num_tokens = params.cu_seqlens_q != nullptr ? params.total_q : params.batch * params.seqlen_q;
    constexpr int kThreads = 256;

    const int64_t dot_threads = int64_t(num_tokens) * params.heads * kDotLanesPerRow;
    flash_bwd_dot_do_o_kernel<Element>
        <<<unsigned((dot_threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(params, num_tokens);
    check_cuda(cudaGetLastError(), "launch of the backward's rowsum(dO * O) kernel");

    constexpr int kSmemSize = Traits::kSmemSize + kSmemRowStatsSize<Traits> + kSmemDqSize<Traits>;
    auto kernel = &flash_bwd_kernel<Traits, Is_dropout, Is_masked>;
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemSize),
               "cudaFuncSetAttribute(max dynamic shared memory) of the backward kernel");
    const int n_blocks = ceil_div(params.seqlen_k, Traits::kBlockN);
    if (n_blocks > 0) {  // no keys at all: dq_accum stays zero (see above), so dq comes out zero
        const int key_splits = params.deterministic ? params.num_splits : std::min(n_blocks, kMaxGridY);
        const dim3 grid(unsigned(params.batch) * unsigned(params.heads), key_splits);
        kernel<<<grid, Traits::kNThreads, kSmemSize, stream>>>(params);
        check_cuda(cudaGetLastError(), "launch of the backward kernel");
    }

    const int64_t convert_threads = int64_t(num_tokens) * params.heads * (params.head_dim / 8);
    flash_bwd_convert_dq_kernel<Element>
        <<<unsigned((convert_threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(params, num_tokens);
    check_cuda(cudaGetLastError(), "launch of the backward's dq conversion kernel");
}

}  // namespace flash
