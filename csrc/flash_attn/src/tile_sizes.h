// The tile of every kernel, per head dim: the one place these choices live. Register pressure
// (accumulators) and shared memory (the tiles) decide; see flash_fwd_launch.h and
// flash_bwd_launch.h for how they are used, and _get_block_size_n in Python for the mirror of
// the forward's key-block size.
#pragma once

namespace flash {

// Forward: (kBlockM, kBlockN, kNWarps); smaller key blocks with dropout (its bookkeeping needs
// registers).
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
FLASH_FWD_TILE(224, 128, 64, 8, 64)
FLASH_FWD_TILE(256, 128, 64, 8, 32)
#undef FLASH_FWD_TILE

// Forward tile of launches with at most 64 query rows and no dropout or mask: decoding
// (flash_attn_with_kvcache packs one query's GQA group into rows) and short unmasked chunks.
// The 128-row tile would spend half its tensor work on rows that do not exist, and decoding is
// bound by memory: 64 rows (one warpgroup) and longer key blocks keep more K/V bytes in flight.
constexpr int kDecodeBlockM = 64;
template <int kHeadDim> struct DecodeTile {
    static constexpr int kBlockM = kDecodeBlockM, kBlockN = kHeadDim <= 128 ? 128 : 64, kNWarps = 4;
};

// Whether a forward launch runs on DecodeTile: the kernel launch and the binding's split-KV
// count both ask this.
__host__ __device__ constexpr bool takes_decode_tile(int seqlen_q, bool dropout, bool masked) {
    return !dropout && !masked && seqlen_q <= kDecodeBlockM;
}

// The warp-specialised forward (flash_fwd_ws_kernel.h): consumer warpgroups of 64 query rows, and
// keys per K/V stage (their S accumulators beside O's must fit 240 registers, 160 with three
// consumers, and Q with two stages of K and V 227 KB of shared memory). The default tile
// (FLASH_ATTN_SM90_WS unset, 1 or 2), and the wide one (3, not yet measured): three consumers at
// d64, more keys per stage at d128 (unmasked), d192 and d256.
template <int kHeadDim, bool Wide, bool Is_masked>
struct WsForwardTile {
    static constexpr int kConsumers = Wide && kHeadDim == 64 ? 3 : 2;
    static constexpr int kBlockN = !Wide ? (kHeadDim <= 128 ? 128 : 64)
                                   : kHeadDim <= 64 ? 128
                                   : kHeadDim <= 128 ? (Is_masked ? 128 : 176)
                                   : kHeadDim <= 192 ? 112
                                                     : 80;
};

// Backward: (kBlockM, kBlockN, kNWarps) and how many warps split the rows of S/dP, of dK/dV
// (their rows are keys) and of dQ; the MMA tiles must divide the block and head dims.
template <int kHeadDim> struct BackwardTile;
#define FLASH_BWD_TILE(D, M, N, W, WM_SDP, WN_DKV, WM_DQ)                                           \
    template <> struct BackwardTile<D> {                                                            \
        static constexpr int kBlockM = M, kBlockN = N, kNWarps = W;                                 \
        static constexpr int kWarpsMSdP = WM_SDP, kWarpsNdKV = WN_DKV, kWarpsMdQ = WM_DQ;           \
    };
FLASH_BWD_TILE(32, 128, 128, 8, 4, 4, 4)
FLASH_BWD_TILE(64, 128, 128, 8, 4, 4, 4)
FLASH_BWD_TILE(96, 64, 128, 8, 2, 4, 4)
FLASH_BWD_TILE(128, 64, 128, 8, 2, 4, 2)
FLASH_BWD_TILE(160, 64, 64, 8, 4, 4, 4)
FLASH_BWD_TILE(192, 64, 64, 8, 4, 2, 2)
FLASH_BWD_TILE(224, 64, 64, 8, 4, 4, 4)
FLASH_BWD_TILE(256, 64, 64, 8, 4, 2, 2)
#undef FLASH_BWD_TILE

}  // namespace flash
