// Small device helpers shared by the attention kernels: register-layout views, type conversion,
// quad reductions, named barriers, the pipelined shared-memory GEMM and the predicated tile copy.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace flash {

using namespace cute;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Hopper-only paths (vector reductions) are compiled for sm_90 and up.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FLASH_ARCH_SM90 1
#else
#define FLASH_ARCH_SM90 0
#endif

// Adds two adjacent floats to global memory: one vector reduction on sm90, two atomics before.
__device__ __forceinline__ void atomic_add_pair(float *gmem, float a, float b) {
#if FLASH_ARCH_SM90
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(gmem), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(gmem, a);
    atomicAdd(gmem + 1, b);
#endif
}

// Registers a block of `threads` threads holds (ptxas gives each thread 64K / threads, in steps of
// 8): what setmaxnreg can redistribute among its warpgroups, no more.
constexpr int ws_register_pool(int threads) { return 65536 / threads / 8 * 8 * threads; }

// Named barrier kId (1-15; 0 is __syncthreads') of kThreads threads (whole warps): wait until all
// have arrived, or arrive and go on. Immediate ids: a register id makes ptxas reserve all 16.
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
    asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_arrive() {
    asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

// The same two with the id in a register (ptxas then reserves all 16): for an id that depends on the
// warpgroup, one barrier instead of a branch between two (which, in the warp-specialised forward,
// cost the main loop its uniform wgmma descriptors).
template <int kThreads>
__device__ __forceinline__ void named_barrier_sync(int id) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
template <int kThreads>
__device__ __forceinline__ void named_barrier_arrive(int id) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// x, computed where this is called: the compiler cannot hoist what is derived from it out of an
// enclosing loop (values hoisted past a main loop hold registers through it).
__device__ __forceinline__ int computed_here(int x) {
    int y;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// The four lanes of a quad hold the same rows of an m16n8 accumulator; reduce across them.
template <typename Op>
__device__ __forceinline__ float quad_allreduce(float x, Op op) {
    x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
    x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
    return x;
}
struct MaxOp { __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct SumOp { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };

// An accumulator fragment seen as a matrix (rows = (2, MMA_M), cols = (2, column groups)) so that
// row-wise softmax, mask and dropout code can index it: the m16n8 layout of mma.sync, ((2 cols,
// 2 rows), MMA_M, MMA_N), or wgmma's ((2 cols, 2 rows, N / 8 groups of 8 columns), MMA_M, MMA_N).
// Either way a thread holds rows r and r + 8 of each 16-row slice and column pairs 8 apart.
template <typename Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_rowcol(Layout acc) {
    static_assert(decltype(rank(acc))::value == 3);
    if constexpr (decltype(rank<0>(acc))::value == 3) {  // wgmma
        return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                           make_layout(get<0, 0>(acc), make_layout(get<0, 2>(acc), get<2>(acc))));
    } else {
        static_assert(decltype(size<0>(acc))::value == 4);
        auto l = logical_divide(acc, Shape<_2>{});  // ((2 cols, 2 rows), MMA_M, MMA_N)
        return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
    }
}

// The same accumulator seen as the A operand of a k16 MMA: two groups of 8 columns side by side
// hold exactly the eight registers of one k16 A fragment (mma.sync and wgmma alike).
template <typename Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_A_operand(Layout acc) {
    static_assert(decltype(rank(acc))::value == 3);
    if constexpr (decltype(rank<0>(acc))::value == 3) {  // wgmma: ((2, 2, N/8), MMA_M, MMA_N)
        auto groups = logical_divide(get<0, 2>(acc), _2{});  // (2, N/16)
        return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0>(groups)), get<1>(acc),
                           make_layout(get<1>(groups), get<2>(acc)));
    } else {
        static_assert(decltype(size<0>(acc))::value == 4);
        auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // (4, MMA_M, (2, MMA_N/2))
        return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
    }
}

// Converts a register tensor element-wise (vectorised: pairs become one cvt instruction).
template <typename To, typename Engine, typename Layout>
__device__ __forceinline__ auto convert_type(Tensor<Engine, Layout> const &src) {
    using From = typename Engine::value_type;
    constexpr int N = decltype(size(src))::value;
    Tensor dst = make_tensor<To>(src.layout());
    auto const &in = *reinterpret_cast<cutlass::Array<From, N> const *>(raw_pointer_cast(src.data()));
    *reinterpret_cast<cutlass::Array<To, N> *>(raw_pointer_cast(dst.data())) =
        cutlass::NumericArrayConverter<To, From, N>{}(in);
    return dst;
}

// acc += A B with A and B loaded from shared memory one k-slice ahead of the MMA that uses them
// (Prefetch), or each right before its MMA (fewer live registers, for register-bound kernels).
// A_in_regs: A is already in registers (P of the P V product).
template <bool A_in_regs = false, bool Prefetch = true, typename Acc, typename TA, typename TB, typename TsA,
          typename TsB, typename TiledMma, typename CopyA, typename CopyB, typename ThrCopyA, typename ThrCopyB>
__device__ __forceinline__ void gemm(Acc &acc, TA &tCrA, TB &tCrB, TsA const &tCsA, TsB const &tCsB,
                                     TiledMma tiled_mma, CopyA copy_a, CopyB copy_b,
                                     ThrCopyA const &thr_copy_a, ThrCopyB const &thr_copy_b) {
    constexpr int kSlices = decltype(size<2>(tCrA))::value;
    Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
    auto load_slice = [&](int i) {
        if constexpr (!A_in_regs) {
            Tensor tCrA_view = thr_copy_a.retile_D(tCrA);
            cute::copy(copy_a, tCsA(_, _, i), tCrA_view(_, _, i));
        }
        cute::copy(copy_b, tCsB(_, _, i), tCrB_view(_, _, i));
    };
    if constexpr (Prefetch) { load_slice(0); }
    CUTE_UNROLL
    for (int i = 0; i < kSlices; ++i) {
        if constexpr (Prefetch) {
            if (i < kSlices - 1) { load_slice(i + 1); }
        } else {
            load_slice(i);
        }
        cute::gemm(tiled_mma, tCrA(_, _, i), tCrB(_, _, i), acc);
    }
}

// Predicates of the column chunks of a tiled copy's partition (from an identity tensor): true
// where the chunk starts below cols_valid (the head dim, a multiple of the 8-element chunk).
template <typename TC>
__device__ __forceinline__ auto col_predicates(TC const &identity, int cols_valid) {
    Tensor pred = make_tensor<bool>(make_shape(size<2>(identity)));
    CUTE_UNROLL
    for (int k = 0; k < size(pred); ++k) { pred(k) = get<1>(identity(0, 0, k)) < cols_valid; }
    return pred;
}

// Copies a (rows, cols) tile partitioned by a tiled copy. Interior tiles (`full`: every row and
// column in bounds) take the unpredicated path; otherwise rows at or beyond `rows_valid` and
// columns whose predicate is false are skipped and, with Clear_OOB, zeroed in the destination
// (shared memory) so that padding contributes nothing to the GEMMs.
template <bool Clear_OOB = true, typename TiledCopy, typename TS, typename TD, typename TC, typename TP>
__device__ __forceinline__ void copy_tile(TiledCopy tiled_copy, TS const &src, TD &dst,
                                          TC const &identity, TP const &col_valid, int rows_valid,
                                          bool full) {
    if (full) {
        CUTE_UNROLL
        for (int m = 0; m < size<1>(src); ++m) {
            CUTE_UNROLL
            for (int k = 0; k < size<2>(src); ++k) { cute::copy(tiled_copy, src(_, m, k), dst(_, m, k)); }
        }
        return;
    }
    CUTE_UNROLL
    for (int m = 0; m < size<1>(src); ++m) {
        if (get<0>(identity(0, m, 0)) < rows_valid) {
            CUTE_UNROLL
            for (int k = 0; k < size<2>(src); ++k) {
                if (col_valid(k)) {
                    cute::copy(tiled_copy, src(_, m, k), dst(_, m, k));
                } else if constexpr (Clear_OOB) {
                    cute::clear(dst(_, m, k));
                }
            }
        } else if constexpr (Clear_OOB) {
            cute::clear(dst(_, m, _));
        }
    }
}

// copy_tile for a source whose rows are not evenly spaced (paged K/V, pages shorter than the
// tile or not aligned to it): row r of the tile starts row_shift(r) elements past where src's
// layout places it. Out-of-bounds rows and columns are zeroed, as in copy_tile.
template <typename TiledCopy, typename TS, typename TD, typename TC, typename TP, typename Shift>
__device__ __forceinline__ void copy_tile_rows(TiledCopy tiled_copy, TS const &src, TD &dst,
                                               TC const &identity, TP const &col_valid, int rows_valid,
                                               Shift row_shift) {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(src); ++m) {
        const int row = get<0>(identity(0, m, 0));
        if (row < rows_valid) {
            const int64_t shift = row_shift(row);
            CUTE_UNROLL
            for (int k = 0; k < size<2>(src); ++k) {
                if (col_valid(k)) {
                    Tensor src_mk = make_tensor(src(_, m, k).data() + shift, src(_, m, k).layout());
                    cute::copy(tiled_copy, src_mk, dst(_, m, k));
                } else {
                    cute::clear(dst(_, m, k));
                }
            }
        } else {
            cute::clear(dst(_, m, _));
        }
    }
}

}  // namespace flash
