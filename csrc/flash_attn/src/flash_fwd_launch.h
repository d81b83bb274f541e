// The launch of the forward kernel. Included only by the generated instantiation units (one per
// dtype x head dim x dropout x mask), which compile in parallel.
#pragma once

#include <algorithm>
#include <type_traits>

#include "cuda_check.h"
#include "flash.h"
#include "flash_fwd_kernel.h"
#include "flash_fwd_ws_kernel.h"
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
    // z: heads fastest, then the split-KV splits (block_range.h).
    const dim3 grid(ceil_div(params.seqlen_q, Traits::kBlockM), params.batch, params.heads * params.num_splits);
    kernel<<<grid, Traits::kNThreads, kSmemSize, stream>>>(params);
    check_cuda(cudaGetLastError(), "launch of the forward kernel");
}

// The warp-specialised sm90 forward (flash_fwd_ws_kernel.h) for the inputs it covers (else the
// default kernel runs), on the tile ws_forward_auto_mode picks, or as FLASH_ATTN_SM90_WS says.
// The choice, from the H200 (torch-free harness, bf16, 16K tokens a batch, each mode back to back):
//  - d64: the wide tile (three consumers) from 2K keys unmasked (+11-14% over the default tile,
//    which beat the default kernel), from 4K causal (at 2K causal it lost 8%);
//  - d128: the default tile from 1K keys (the wide one was 3-6% slower below 16K; at 1K, with O
//    through a TMA store, 1.24x the default kernel unmasked and 1.10-1.14x causal);
//  - d192 / d256: from 1K keys, the wide tile unmasked (d256: 1.14-1.44x the default kernel) and the
//    default tile causal (1.11-1.35x; the wide one was 4-10% slower there).
// Below those lengths, and where the default kernel takes the decode tile (its 128 rows would be
// mostly empty), the default kernel.
constexpr int kWsMinKeys = 2048;

__host__ constexpr int ws_forward_auto_mode(int head_dim, bool masked, int seqlen_k) {
    if (head_dim <= 64) {
        if (seqlen_k < kWsMinKeys) { return 0; }
        return masked && seqlen_k < 2 * kWsMinKeys ? 2 : 3;
    }
    if (head_dim <= 128) { return seqlen_k >= kWsMinKeys / 2 ? 2 : 0; }
    if (seqlen_k < kWsMinKeys / 2) { return 0; }
    return masked ? 2 : 3;
}

template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
bool launch_fwd_ws(AttentionParams &params, cudaStream_t stream) {
    if constexpr (Is_dropout || kHeadDim % 64 != 0) {
        return false;
    } else {
        // FLASH_ATTN_SM90_WS: 0 never, 1 the plain consumer loop, 2 the overlapped, ping-pong one,
        // 3 that on the wide tile (WsForwardTile); unset, ws_forward_auto_mode (lengths: the max
        // over the batch, so plain and varlen calls of the same lengths agree).
        static const int mode = sm90_ws_flag("FLASH_ATTN_SM90_WS", 3);
        const int use = mode != kWsAuto ? mode
                        : takes_decode_tile(params.seqlen_q, Is_dropout, Is_masked)
                            ? 0
                            : ws_forward_auto_mode(kHeadDim, Is_masked, params.seqlen_k);
        // The rest of what it does not cover is Ws::supports' (tma_rows.h).
        if (use == 0 || params.num_splits != 1 || params.s_dmask_ptr != nullptr) { return false; }
        auto launch = [&](auto tile, auto overlap) {
            using Tile = decltype(tile);
            using Ws = ForwardWs<kHeadDim, Element, Tile::kConsumers, Tile::kBlockN>;
            if (!Ws::supports(params)) { return false; }
            auto kernel = &flash_fwd_ws_kernel<Ws, Is_masked, decltype(overlap)::value>;
            check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Ws::kSmemSize),
                       "cudaFuncSetAttribute(max dynamic shared memory) of the warp-specialised forward kernel");
            static const int num_sms = [] {
                int device = 0, count = 0;
                cudaGetDevice(&device);
                cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
                return count;
            }();
            const typename Ws::KernelArgs args = Ws::make_args(params, Is_masked, num_sms);
            const dim3 grid(std::min(args.schedule.num_units, num_sms));  // persistent: one CTA per SM
            kernel<<<grid, Ws::kThreads, Ws::kSmemSize, stream>>>(args);
            check_cuda(cudaGetLastError(), "launch of the warp-specialised forward kernel");
            return true;
        };
        using DefaultTile = WsForwardTile<kHeadDim, false, Is_masked>;
        switch (use) {
            case 1: return launch(DefaultTile{}, std::false_type{});
            case 2: return launch(DefaultTile{}, std::true_type{});
            default: return launch(WsForwardTile<kHeadDim, true, Is_masked>{}, std::true_type{});
        }
    }
}

template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
void run_mha_fwd_(AttentionParams &params, cudaStream_t stream) {
    if (launch_fwd_ws<Element, kHeadDim, Is_dropout, Is_masked>(params, stream)) { return; }
    if constexpr (takes_decode_tile(0, Is_dropout, Is_masked)) {
        if (takes_decode_tile(params.seqlen_q, Is_dropout, Is_masked)) {
            return launch_fwd<DecodeTile<kHeadDim>, Element, kHeadDim, Is_dropout, Is_masked>(params, stream);
        }
    }
    launch_fwd<ForwardTile<kHeadDim, Is_dropout>, Element, kHeadDim, Is_dropout, Is_masked>(params, stream);
}

}  // namespace flash
