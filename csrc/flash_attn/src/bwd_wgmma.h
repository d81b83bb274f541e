// The dV, dK and dQ products of the attention backward on Hopper's warpgroup MMA (wgmma). The
// tensor cores read both operands straight from shared memory, so these three GEMMs issue no
// ldmatrix and keep no operand fragments in registers: on the mma.sync path they account for two
// thirds of the shared-memory traffic of an iteration and most of its MIO-queue stalls.
//
// The operands are the very tiles the mma.sync path uses (P, dS, Q, dO, K), seen through
// address-swizzled layouts as wgmma descriptors describe them: 128-byte rows swizzled with
// Swizzle<3,4,3> on the byte address equal our Swizzle<3,3,3> on the element offset because every
// tile starts 1024-byte aligned.
#pragma once

#include <cute/tensor.hpp>

#include "kernel_traits.h"

// wgmma exists in the sm_90a device pass only; every other pass takes the mma.sync path.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASH_WGMMA_ARCH 1
#else
#define FLASH_WGMMA_ARCH 0
#endif

namespace flash {

using namespace cute;

template <typename Traits>
struct BackwardWgmma {
    using Element = typename Traits::Element;
    static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;

    // Two warpgroups, 64-element (128-byte) chunks everywhere: head dims 64 and 128 with key blocks
    // of 128 (the rest keep mma.sync).
    static constexpr bool kApplies = Traits::kNWarps == 8 && kBlockN == 128 && kBlockM % 64 == 0 &&
                                     (kHeadDim == 64 || kHeadDim == 128) && Traits::kBlockKSmem == 64 &&
                                     Traits::kBlockNSmemPdS == 64;
    static constexpr bool kEnabled = kApplies && FLASH_WGMMA_ARCH;

    // dV, dK (kBlockN x head dim): one warpgroup per 64 keys.
    using TiledMmadKV = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, _16>, GMMA::Major::MN,
                             GMMA::Major::MN>(),
        Layout<Shape<Int<kBlockN / 64>, _1, _1>>{}));
    // dQ (kBlockM x head dim): the warpgroups split 128 rows, or the columns of 64 rows.
    static constexpr int kWarpgroupsMdQ = kBlockM / 64 >= 2 ? 2 : 1, kWarpgroupsNdQ = 2 / kWarpgroupsMdQ;
    using TiledMmadQ = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / kWarpgroupsNdQ>, _16>,
                             GMMA::Major::K, GMMA::Major::MN>(),
        Layout<Shape<Int<kWarpgroupsMdQ>, Int<kWarpgroupsNdQ>, _1>>{}));

    // A tile stored (rows, cols) in 64-column chunks (chunk after chunk, rows within a chunk), seen
    // as (cols, rows) with cols contiguous (an M- or N-major operand over cols, contracting rows),
    // or as (rows, cols) with cols contiguous (a K-major operand contracting cols).
    template <int kRows, int kCols>
    using ColsMajor = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kCols>, Int<kRows>>{},
                                             Step<_2, _1>{}));
    template <int kRows, int kCols>
    using KMajor = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kRows>, Int<kCols>>{}));

    using SmemLayoutPdSt = ColsMajor<kBlockM, kBlockN>;  // P^T, dS^T: A of dV, dK (keys x queries)
    using SmemLayoutQdOt = ColsMajor<kBlockM, kHeadDim>; // dO, Q: B of dV, dK (head dim x queries)
    using SmemLayoutdS = KMajor<kBlockM, kBlockN>;       // dS: A of dQ (queries x keys)
    using SmemLayoutKt = ColsMajor<kBlockN, kHeadDim>;   // K: B of dQ (head dim x keys)
};

// Makes shared-memory writes of the generic proxy (st.shared, cp.async) visible to wgmma, which
// reads through the async proxy; the writers then meet the readers at a barrier.
__device__ __forceinline__ void fence_smem_for_wgmma() {
#if FLASH_WGMMA_ARCH
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Issues acc (+)= A B over every k-slice as one wgmma batch (not waited for). Zero_init: the first
// slice overwrites acc instead of adding to it.
template <bool Zero_init, typename TiledMma, typename TA, typename TB, typename Acc>
__device__ __forceinline__ void wgmma_gemm(TiledMma &tiled_mma, TA const &tCrA, TB const &tCrB, Acc &acc) {
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    if constexpr (Zero_init) { tiled_mma.accumulate_ = GMMA::ScaleOut::Zero; }
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
        cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(acc);
}

}  // namespace flash
