// The launch of the forward kernel. Included only by the generated instantiation units (one per
// dtype x head dim x dropout x mask), which compile in parallel.
#pragma once

#include <algorithm>
#include <cstdlib>
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
// default kernel runs): from kWsMinKeys keys at head dims 64 and 128, or as FLASH_ATTN_SM90_WS says.
constexpr int kWsMinKeys = 2048;

template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
bool launch_fwd_ws(AttentionParams &params, cudaStream_t stream) {
    if constexpr (Is_dropout || kHeadDim % 64 != 0) {
        return false;
    } else {
        // FLASH_ATTN_SM90_WS: 0 never, 1 the plain consumer loop, 2 the overlapped, ping-pong one,
        // 3 that on the wide tile (WsForwardTile; not yet measured); unset, mode 2 from 2K keys (max
        // over the batch, so plain and varlen calls of the same lengths agree) at head dims 64 and
        // 128: on the H200 it matched or beat the default kernel at every measured shape from 2K (at
        // d64 s1k it lost by 1-5%), except where the default takes the decode tile (its 128 rows
        // would be mostly empty). Head dims 192 and 256 take it only with the flag set (not yet
        // measured).
        constexpr int kAuto = -1;
        static const int mode = [] {
            const char *flag = std::getenv("FLASH_ATTN_SM90_WS");
            if (!current_device_is_sm90()) { return 0; }
            if (flag == nullptr || flag[0] == '\0') { return kAuto; }
            return flag[0] >= '1' && flag[0] <= '3' && flag[1] == '\0' ? flag[0] - '0' : 0;
        }();
        const bool auto_takes_ws = kHeadDim <= 128 && params.seqlen_k >= kWsMinKeys &&
                                   !takes_decode_tile(params.seqlen_q, Is_dropout, Is_masked);
        const int use = mode == kAuto ? (auto_takes_ws ? 2 : 0) : mode;
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
