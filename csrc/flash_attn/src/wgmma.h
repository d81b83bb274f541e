// Hopper's warpgroup MMA (wgmma) for the attention kernels: the tensor cores read shared-memory
// operands straight through descriptors, so these GEMMs issue no ldmatrix and keep no operand
// fragments in registers (on the mma.sync path ldmatrix traffic and the MIO queue it fills are
// what limits the kernels on the H200).
//
// The operands are the very tiles the mma.sync path uses (Q, K, V, dO, P, dS), seen through
// address-swizzled layouts as wgmma descriptors describe them: 128-byte rows swizzled with
// Swizzle<3,4,3> on the byte address equal our Swizzle<3,3,3> on the element offset because every
// tile starts 1024-byte aligned. Only tiles with 64-element (128-byte) row chunks qualify.
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

// Views of a tile stored (rows, cols) in 64-column chunks (chunk after chunk, rows within a
// chunk): as (cols, rows) with cols contiguous (an M- or N-major operand over cols that contracts
// rows), or as (rows, cols) (a K-major operand that contracts cols).
template <typename Element, int kRows, int kCols>
using SmemColsMajor = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                             Shape<Int<kCols>, Int<kRows>>{}, Step<_2, _1>{}));
template <typename Element, int kRows, int kCols>
using SmemKMajor = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kRows>, Int<kCols>>{}));

template <typename Element, typename Layout>
__device__ __forceinline__ auto smem_view(Element *ptr, Layout layout) {
    return make_tensor(make_smem_ptr(ptr), layout);
}

// The first thread (in a tiled MMA's numbering) of the warpgroup of mma_thread, read from lane 0 so
// that the compiler knows it is the same across the warp. A wgmma's shared-memory operands are
// partitioned by warpgroup only: sliced with this thread, their descriptors stay in uniform
// registers, where sliced by each thread they were rebuilt in per-thread registers (or spilled)
// and moved over before every wgmma.
__device__ __forceinline__ int warpgroup_first_thread(int mma_thread) {
    return __shfl_sync(0xffffffff, mma_thread / 128, 0) * 128;
}

// Makes shared-memory writes of the generic proxy (st.shared, cp.async) visible to wgmma, which
// reads through the async proxy; the writers then meet the readers at a barrier.
__device__ __forceinline__ void fence_smem_for_wgmma() {
#if FLASH_WGMMA_ARCH
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Issues acc (+)= A B over every k-slice as one wgmma batch (not waited for). A comes from shared
// memory (descriptors) or, with A_in_regs, registers. Zero_init: the first slice overwrites acc.
template <bool Zero_init, bool A_in_regs = false, typename TiledMma, typename TA, typename TB, typename Acc>
__device__ __forceinline__ void wgmma_gemm(TiledMma &tiled_mma, TA &&tCrA, TB const &tCrB, Acc &acc) {
    if constexpr (A_in_regs) { warpgroup_fence_operand(tCrA); }
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
    if constexpr (A_in_regs) { warpgroup_fence_operand(tCrA); }
}

// Which tiles wgmma takes: 64-element (128-byte) row chunks everywhere, whole warpgroups; the
// rest keep mma.sync. Outside the sm_90a pass every tile takes mma.sync: the specialisations below
// are chosen with FLASH_WGMMA_ARCH, so that an sm_80 pass never lays its accumulators out for
// wgmma (the mma.sync products would not fit them).
template <typename Traits>
constexpr bool kForwardWgmmaApplies = Traits::kNWarps % 4 == 0 && Traits::kBlockM % (16 * Traits::kNWarps) == 0 &&
                                      Traits::kBlockN % 16 == 0 && Traits::kHeadDim % 64 == 0 &&
                                      Traits::kBlockKSmem == 64;
template <typename Traits>
constexpr bool kBackwardWgmmaApplies = Traits::kNWarps == 8 && Traits::kBlockN == 128 && Traits::kBlockM % 64 == 0 &&
                                       (Traits::kHeadDim == 64 || Traits::kHeadDim == 128) &&
                                       Traits::kBlockKSmem == 64 && Traits::kBlockNSmemPdS == 64;

// The forward: S = Q K^T (both from shared memory) and O += P V (P from registers), one warpgroup
// per 64 query rows. Where wgmma does not apply, the MMAs are the mma.sync ones.
template <typename Traits, bool = kForwardWgmmaApplies<Traits> && FLASH_WGMMA_ARCH>
struct ForwardWgmma {
    static constexpr bool kEnabled = false;
    using TiledMmaS = typename Traits::TiledMma;
    using TiledMmaO = typename Traits::TiledMma;
};

// The forward's products and operand views on wgmma for a (kBlockM queries, kBlockN keys) tile
// whose query rows kWarpgroups warpgroups split (64 rows each, or several 64-row slices): the
// mma.sync/wgmma kernel's (below) and the warp-specialised kernel's (flash_fwd_ws_kernel.h).
template <typename Element, int kWarpgroups, int kBlockM, int kBlockN, int kHeadDim>
struct ForwardWgmmaTile {
    using TiledMmaS = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
        Layout<Shape<Int<kWarpgroups>, _1, _1>>{}));
    using TiledMmaO = decltype(make_tiled_mma(
        GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                             GMMA::Major::MN>(),
        Layout<Shape<Int<kWarpgroups>, _1, _1>>{}));

    using SmemLayoutQ = SmemKMajor<Element, kBlockM, kHeadDim>;      // A of S (queries x head dim)
    using SmemLayoutK = SmemKMajor<Element, kBlockN, kHeadDim>;      // B of S (keys x head dim)
    using SmemLayoutVt = SmemColsMajor<Element, kBlockN, kHeadDim>;  // B of O (head dim x keys)
};

template <typename Traits>
struct ForwardWgmma<Traits, true>
    : ForwardWgmmaTile<typename Traits::Element, Traits::kNWarps / 4, Traits::kBlockM, Traits::kBlockN,
                       Traits::kHeadDim> {
    static constexpr bool kEnabled = true;
};

// The backward's five products: S = Q K^T and dP = dO V^T (both operands from shared memory, so
// no operand fragments live in registers across the element-wise work), dV, dK and dQ. Where
// wgmma does not apply, the MMAs are the mma.sync ones.
template <typename Traits, bool = kBackwardWgmmaApplies<Traits> && FLASH_WGMMA_ARCH>
struct BackwardWgmma {
    static constexpr bool kEnabled = false;
    using TiledMmaSdP = typename Traits::TiledMmaSdP;
    using TiledMmadKV = typename Traits::TiledMmadKV;
    using TiledMmadQ = typename Traits::TiledMmadQ;
};

template <typename Traits>
struct BackwardWgmma<Traits, true> {
    using Element = typename Traits::Element;
    static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    static constexpr bool kEnabled = true;

    // S, dP (kBlockM x kBlockN): the two warpgroups split 128 rows, or the columns of 64 rows.
    // Either way a warp owns 16 rows by whole 16-column cells, as dropout.h needs.
    static constexpr int kWarpgroupsMSdP = kBlockM / 64 >= 2 ? 2 : 1, kWarpgroupsNSdP = 2 / kWarpgroupsMSdP;
    using TiledMmaSdP = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN / kWarpgroupsNSdP>, Int<kHeadDim>>>(),
        Layout<Shape<Int<kWarpgroupsMSdP>, Int<kWarpgroupsNSdP>, _1>>{}));
    static_assert(kBlockM % (64 * kWarpgroupsMSdP) == 0);

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

    using SmemLayoutQdO = SmemKMajor<Element, kBlockM, kHeadDim>;      // Q, dO: A of S, dP
    using SmemLayoutKV = SmemKMajor<Element, kBlockN, kHeadDim>;       // K, V: B of S, dP
    using SmemLayoutPdSt = SmemColsMajor<Element, kBlockM, kBlockN>;   // P^T, dS^T: A of dV, dK
    using SmemLayoutQdOt = SmemColsMajor<Element, kBlockM, kHeadDim>;  // dO, Q: B of dV, dK
    using SmemLayoutdS = SmemKMajor<Element, kBlockM, kBlockN>;        // dS: A of dQ
    using SmemLayoutKt = SmemColsMajor<Element, kBlockN, kHeadDim>;    // K: B of dQ
};

}  // namespace flash
