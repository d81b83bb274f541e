// Tile shapes, shared-memory layouts and copy/MMA atoms of the sm80-class (mma.sync) kernels.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "paged_kv.h"

namespace flash {

using namespace cute;

// What every attention kernel of a head dim, tile, thread count and dtype shares: the MMA atom,
// the swizzled shared-memory rows, the shared->register and global->shared copies.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNThreads_, typename Element_>
struct CommonTraits {
    using Element = Element_;
    using ElementAccum = float;
    using index_t = int64_t;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;  // query rows of a tile
    static constexpr int kBlockN = kBlockN_;  // key rows of a tile
    static constexpr int kNThreads = kNThreads_;
    static constexpr int kNWarps = kNThreads / 32;
    static_assert(kHeadDim % 32 == 0);

    using MmaAtom = MMA_Atom<std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                                SM80_16x8x16_F32F16F16F32_TN,
                                                SM80_16x8x16_F32BF16BF16F32_TN>>;

    // Shared memory rows are cut in chunks of 64 elements (128 bytes) where the head dim allows,
    // and swizzled so that both 16-byte cp.async writes and ldmatrix reads are conflict-free.
    static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
    static constexpr int kSwizzle = kBlockKSmem == 32 ? 2 : 3;
    using SmemLayoutAtom = decltype(composition(
        Swizzle<kSwizzle, 3, 3>{},
        Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));
    // A (rows, head_dim) tile, and the same bytes seen transposed as (head_dim, rows): the B
    // operand of a product that contracts over the rows (P V, dS K, P^T dO, dS^T Q).
    template <int kRows>
    using SmemLayoutRows = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kRows>, Int<kHeadDim>>{}));
    template <int kRows>
    using SmemLayoutRowsT = decltype(composition(
        SmemLayoutRows<kRows>{}, make_layout(Shape<Int<kHeadDim>, Int<kRows>>{}, GenRowMajor{})));
    template <int kRows>
    using SmemLayoutRowsTNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutRowsT<kRows>{}));

    using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
    using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
    // Registers <-> shared memory of an accumulator tile (two adjacent elements per access).
    using SmemCopyAtomAcc = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

    // Global memory moves 16 bytes per thread and copy; kGmemThreadsPerRow threads cover one
    // kBlockKSmem-wide chunk of a row.
    static constexpr int kGmemElemsPerLoad = int(sizeof(cute::uint128_t) / sizeof(Element));
    static_assert(kHeadDim % kGmemElemsPerLoad == 0);
    static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
    static_assert(kNThreads % kGmemThreadsPerRow == 0);
    // One global->shared copy step moves this many rows; every tile's row count must be a
    // multiple of it, or the threads past the tile's last row copy out of bounds.
    static constexpr int kGmemRowsPerCopy = kNThreads / kGmemThreadsPerRow;
    static_assert(kBlockM % kGmemRowsPerCopy == 0 && kBlockN % kGmemRowsPerCopy == 0,
                  "the query and key tiles must be whole global->shared copy steps");
    using GmemLayoutAtom = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                  Stride<Int<kGmemThreadsPerRow>, _1>>;
    using GmemTiledCopyQKV = decltype(make_tiled_copy(
        Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
        Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));
    using GmemTiledCopyO = decltype(make_tiled_copy(
        Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{}, GmemLayoutAtom{},
        Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));
};

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename Element_>
struct ForwardTraits : CommonTraits<kHeadDim_, kBlockM_, kBlockN_, kNWarps_ * 32, Element_> {
    using Base = CommonTraits<kHeadDim_, kBlockM_, kBlockN_, kNWarps_ * 32, Element_>;
    using typename Base::Element;
    using typename Base::MmaAtom;
    using Base::kHeadDim;
    using Base::kNWarps;
    using Base::kBlockM;
    using Base::kBlockN;
    static_assert(kBlockN % 16 == 0 && kBlockM % (16 * kNWarps) == 0);

    // Warps split the query rows only, so a warp owns whole rows of S and the row statistics of
    // the softmax need no cross-warp reduction. The N tile of 16 lets one ldmatrix.x4 feed two
    // n8 atoms of the B operand.
    using TiledMma = TiledMMA<MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;

    using SmemLayoutQ = typename Base::template SmemLayoutRows<kBlockM>;
    using SmemLayoutKV = typename Base::template SmemLayoutRows<kBlockN>;
    using SmemLayoutVt = typename Base::template SmemLayoutRowsT<kBlockN>;  // V as the B operand of P V
    using SmemLayoutVtNoSwizzle = typename Base::template SmemLayoutRowsTNoSwizzle<kBlockN>;
    using SmemLayoutO = SmemLayoutQ;  // O is staged through the bytes of Q

    static constexpr int kSmemQSize = int(size(SmemLayoutQ{})) * int(sizeof(Element));
    static constexpr int kSmemKVSize = 2 * int(size(SmemLayoutKV{})) * int(sizeof(Element));
    // Past K and V: a paged K/V's row lookups of two key blocks.
    static constexpr int kSmemPagedRowsSize = PagedRows<kBlockN>::kSmemSize;
    static constexpr int kSmemSize = kSmemQSize + kSmemKVSize + kSmemPagedRowsSize;
};

// The backward kernel: one CTA owns kBlockN keys (K, V, and their dK, dV accumulators) and walks
// the query blocks of kBlockM rows. Three tiled MMAs: S = Q K^T and dP = dO V^T (kBlockM x kBlockN),
// dV = P^T dO and dK = dS^T Q (kBlockN x head_dim), dQ = dS K (kBlockM x head_dim); kWarpsM* say
// how many warps split the rows of each, the rest split the columns.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kWarpsMSdP, int kWarpsNdKV,
          int kWarpsMdQ, typename Element_>
struct BackwardTraits : CommonTraits<kHeadDim_, kBlockM_, kBlockN_, kNWarps_ * 32, Element_> {
    using Base = CommonTraits<kHeadDim_, kBlockM_, kBlockN_, kNWarps_ * 32, Element_>;
    using typename Base::Element;
    using typename Base::MmaAtom;
    using Base::kHeadDim;
    using Base::kNWarps;
    using Base::kBlockM;
    using Base::kBlockN;

    // S and dP: each warp owns 16 contiguous columns per tile (two adjacent n8 atoms), so a lane
    // holds whole 16x16 dropout cells, exactly as in the forward kernel (see dropout.h).
    static constexpr int kWarpsNSdP = kNWarps / kWarpsMSdP;
    using TiledMmaSdP = TiledMMA<
        MmaAtom, Layout<Shape<Int<kWarpsMSdP>, Int<kWarpsNSdP>, _1>>,
        Tile<Int<16 * kWarpsMSdP>, Layout<Shape<_8, Int<kWarpsNSdP>, _2>, Stride<_1, _16, _8>>, _16>>;
    using TiledMmadKV = TiledMMA<MmaAtom, Layout<Shape<Int<kWarpsNdKV>, Int<kNWarps / kWarpsNdKV>, _1>>,
                                 Tile<Int<16 * kWarpsNdKV>, Int<16 * kNWarps / kWarpsNdKV>, _16>>;
    using TiledMmadQ = TiledMMA<MmaAtom, Layout<Shape<Int<kWarpsMdQ>, Int<kNWarps / kWarpsMdQ>, _1>>,
                                Tile<Int<16 * kWarpsMdQ>, Int<16 * kNWarps / kWarpsMdQ>, _16>>;
    static_assert(kBlockM % (16 * kWarpsMSdP) == 0 && kBlockN % (16 * kWarpsNSdP) == 0);
    static_assert(kBlockN % (16 * kWarpsNdKV) == 0 && kHeadDim % (16 * kNWarps / kWarpsNdKV) == 0);
    static_assert(kBlockM % (16 * kWarpsMdQ) == 0 && kHeadDim % (16 * kNWarps / kWarpsMdQ) == 0);

    // Q, dO (double-buffered), K, V, each also seen transposed.
    using SmemLayoutQdO = typename Base::template SmemLayoutRows<kBlockM>;
    using SmemLayoutQdOt = typename Base::template SmemLayoutRowsT<kBlockM>;
    using SmemLayoutQdOtNoSwizzle = typename Base::template SmemLayoutRowsTNoSwizzle<kBlockM>;
    using SmemLayoutKV = typename Base::template SmemLayoutRows<kBlockN>;
    using SmemLayoutKt = typename Base::template SmemLayoutRowsT<kBlockN>;
    using SmemLayoutKtNoSwizzle = typename Base::template SmemLayoutRowsTNoSwizzle<kBlockN>;

    // P and dS (kBlockM x kBlockN), read back transposed as the A operands of dV and dK.
    static constexpr int kBlockNSmemPdS = kBlockN % 64 == 0 ? 64 : 32;
    static constexpr int kSwizzlePdS = kBlockNSmemPdS == 32 ? 2 : 3;
    using SmemLayoutAtomPdS = decltype(composition(
        Swizzle<kSwizzlePdS, 3, 3>{}, Layout<Shape<_8, Int<kBlockNSmemPdS>>, Stride<Int<kBlockNSmemPdS>, _1>>{}));
    using SmemLayoutPdS = decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
    using SmemLayoutPdSt = decltype(composition(
        SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));
    using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));

    static constexpr int kSmemQdOSize = int(size(SmemLayoutQdO{})) * int(sizeof(Element));  // one buffer
    static constexpr int kSmemKVSize = int(size(SmemLayoutKV{})) * int(sizeof(Element));    // K or V
    static constexpr int kSmemPdSSize = int(size(SmemLayoutPdS{})) * int(sizeof(Element));  // P or dS
    static constexpr int kSmemSize = 4 * kSmemQdOSize + 2 * kSmemKVSize + 2 * kSmemPdSSize;
};

}  // namespace flash
