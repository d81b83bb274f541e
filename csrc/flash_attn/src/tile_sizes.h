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
