// Tile choice per head dim and the launch of the forward kernel. Included only by the generated
// instantiation units (one per dtype x head dim x dropout x mask), which compile in parallel.
#pragma once

#include <stdexcept>
#include <string>

#include "flash.h"
#include "flash_fwd_kernel.h"
#include "kernel_traits.h"

namespace flash {

inline void check_cuda(cudaError_t status, const char *what) {
    if (status != cudaSuccess) {
        throw std::runtime_error(std::string("flash_attn: ") + what + " failed: " + cudaGetErrorString(status));
    }
}

// (kBlockM, kBlockN, kNWarps) of the forward kernel. Register pressure (the O accumulator and
// S) and shared memory (Q + K + V tiles) decide: larger tiles for small head dims, smaller key
// blocks with dropout (its bookkeeping needs registers). Mirrored by _get_block_size_n in Python.
template <int kHeadDim, bool Is_dropout> struct ForwardTile;
#define FLASH_FWD_TILE(D, M, N, W, N_DROPOUT)                                                       \
    template <> struct ForwardTile<D, false> { static constexpr int kBlockM = M, kBlockN = N, kNWarps = W; }; \
    template <> struct ForwardTile<D, true> { static constexpr int kBlockM = M, kBlockN = N_DROPOUT, kNWarps = W; };
FLASH_FWD_TILE(32, 128, 128, 4, 64)
FLASH_FWD_TILE(64, 128, 128, 4, 64)
FLASH_FWD_TILE(96, 128, 64, 4, 64)
FLASH_FWD_TILE(128, 128, 64, 4, 32)
FLASH_FWD_TILE(160, 128, 32, 4, 32)
FLASH_FWD_TILE(192, 128, 64, 8, 32)
FLASH_FWD_TILE(224, 128, 64, 8, 32)
FLASH_FWD_TILE(256, 128, 64, 8, 32)
#undef FLASH_FWD_TILE

template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
void run_mha_fwd_(AttentionParams &params, cudaStream_t stream) {
    using Tile = ForwardTile<kHeadDim, Is_dropout>;
    using Traits = ForwardTraits<kHeadDim, Tile::kBlockM, Tile::kBlockN, Tile::kNWarps, Element>;
    constexpr int kSmemSize = Traits::kSmemSize;
    auto kernel = &flash_fwd_kernel<Traits, Is_dropout, Is_masked>;
    if (kSmemSize >= 48 * 1024) {
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemSize),
                   "cudaFuncSetAttribute(max dynamic shared memory) of the forward kernel");
    }
    const dim3 grid(ceil_div(params.seqlen_q, Traits::kBlockM), params.batch, params.heads);
    kernel<<<grid, Traits::kNThreads, kSmemSize, stream>>>(params);
    check_cuda(cudaGetLastError(), "launch of the forward kernel");
}

}  // namespace flash
