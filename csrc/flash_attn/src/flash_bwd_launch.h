// The launch of the backward: softmax_d (which also zeroes dq_accum), the key-block kernel, and
// the dq conversion. Included only by the generated instantiation units (one per dtype x head dim
// x dropout x mask).
#pragma once

#include "cuda_check.h"
#include "flash.h"
#include "flash_bwd_kernel.h"
#include "flash_bwd_ws_kernel.h"
#include "kernel_traits.h"
#include "tile_sizes.h"

namespace flash {

// The warp-specialised sm90 backward (flash_bwd_ws_kernel.h) for the calls it covers (else the
// key-block kernel runs): from kWsBwdMinKeys keys, or as FLASH_ATTN_SM90_WS_BWD says (read once
// per process: 0 never, 1 wherever it covers). On the H200 (harness, bf16, both kernels on
// BackwardCta's grid) it beat the key-block kernel from 2K keys by 4-16% at d64 and 9-27% at
// d128; at 1K keys, once d64 took K and V from registers (session sixteenth), by 0.6% at d64
// unmasked, 3.5% at d64 causal, 3% at d128 causal and 8% at d128 unmasked. d256 (64-key blocks,
// the head dim split between the warpgroups) beat it by 39-61% at 1K-16K keys (+21% at 1K causal).
constexpr int kWsBwdMinKeys = 1024;

template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
bool launch_bwd_ws(AttentionParams &params, cudaStream_t stream) {
    if constexpr (kHeadDim != 64 && kHeadDim != 128 && kHeadDim != 256) {
        return false;
    } else {
        static const int mode = sm90_ws_flag("FLASH_ATTN_SM90_WS_BWD", 1);
        const bool use = mode == kWsAuto ? params.seqlen_k >= kWsBwdMinKeys : mode == 1;
        using Ws = BackwardWs<kHeadDim, Element>;
        if (!use || !Ws::supports(params)) { return false; }
        auto launch = [&](auto kernel) {
            check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Ws::kSmemSize),
                       "cudaFuncSetAttribute(max dynamic shared memory) of the warp-specialised backward kernel");
            const typename Ws::KernelArgs args = Ws::make_args(params);
            const int n_blocks = ceil_div(params.seqlen_k, Ws::kBlockN);
            kernel<<<bwd_grid_size(params, n_blocks), Ws::kThreads, Ws::kSmemSize, stream>>>(args);
            check_cuda(cudaGetLastError(), "launch of the warp-specialised backward kernel");
        };
        // Masked or not is compile-time; an unmasked d64 call takes turns by its lengths (two kernels).
        if constexpr (Ws::kPingPong && !Is_masked) {
            if (Ws::unmasked_takes_turns(params)) {
                launch(&flash_bwd_ws_kernel<Ws, Is_dropout, Is_masked, true>);
                return true;
            }
        }
        launch(&flash_bwd_ws_kernel<Ws, Is_dropout, Is_masked, Ws::kPingPong && Is_masked>);
        return true;
    }
}

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

    if (!launch_bwd_ws<Element, kHeadDim, Is_dropout, Is_masked>(params, stream)) {
        constexpr int kSmemSize = Traits::kSmemSize + kSmemRowStatsSize<Traits> + kSmemDqSize<Traits>;
        auto kernel = &flash_bwd_kernel<Traits, Is_dropout, Is_masked>;
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemSize),
                   "cudaFuncSetAttribute(max dynamic shared memory) of the backward kernel");
        const int n_blocks = ceil_div(params.seqlen_k, Traits::kBlockN);
        if (n_blocks > 0) {  // no keys at all: dq_accum stays zero (see above), so dq comes out zero
            kernel<<<bwd_grid_size(params, n_blocks), Traits::kNThreads, kSmemSize, stream>>>(params);
            check_cuda(cudaGetLastError(), "launch of the backward kernel");
        }
    }

    const int64_t convert_threads = int64_t(num_tokens) * params.heads * (params.head_dim / 8);
    flash_bwd_convert_dq_kernel<Element>
        <<<unsigned((convert_threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(params, num_tokens);
    check_cuda(cudaGetLastError(), "launch of the backward's dq conversion kernel");
}

}  // namespace flash
