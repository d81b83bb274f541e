// Where a backward CTA's results go: dK and dV of its key block (scaled, straight from registers or
// staged through shared memory), and each query block's dQ added in fp32 into dq_accum (vector
// atomics, or one bulk reduction of a tile staged in shared memory on the sm90 paths).
#pragma once

#include <cute/tensor.hpp>

#include "utils.h"
#include "wgmma.h"

namespace flash {

using namespace cute;

// dq_accum is (num_splits, heads, rows, kernel head dim) fp32 with rows = batch * seqlen_q_rounded
// (padded inputs) or total_q + 128 (varlen), so that a query block's rows are one contiguous range.
// Within a row the 16-byte chunks of columns are permuted by the row (chunk ^ row % 8; the kernel
// head dims are multiples of 32): the sm90 path stages a dQ tile in shared memory in exactly
// dq_accum's byte order and adds it with one bulk reduction, and this order spreads the tile's
// stores over the banks. Every writer and reader of dq_accum places columns with dq_accum_col.
__host__ __device__ __forceinline__ int dq_accum_col(int64_t row, int col) {
    return ((col >> 2) ^ int(row & 7)) * 4 + (col & 3);
}

// The sm90 path's dQ tile: shared memory -> dq_accum as one asynchronous bulk reduction (add) by
// one thread, and its waits: for the source to have been read (the buffer is free again), and for
// the additions to have landed.
__device__ __forceinline__ void bulk_add_to_global(float *gmem, const float *smem, int bytes) {
#if FLASH_WGMMA_ARCH
    const uint32_t smem_addr = uint32_t(__cvta_generic_to_shared(smem));
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(gmem), "r"(smem_addr), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void bulk_wait_source_read() {
#if FLASH_WGMMA_ARCH
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void bulk_wait_done() {
#if FLASH_WGMMA_ARCH
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// Writes a dK or dV accumulator tile (tiled_mma_dkv layout), scaled, to the rows of the key
// block that exist, straight from registers: adjacent column pairs as one 4-byte store where the
// tensor's alignment allows (any strides are accepted). tid: the thread's index in tiled_mma
// (unsigned, as below).
template <typename Element, int kBlockN, int kHeadDim, typename Acc, typename TiledMma>
__device__ __forceinline__ void store_dkv(Acc const &acc, TiledMma const &tiled_mma, unsigned tid, void *ptr,
                                          int64_t offset, int64_t row_stride, int rows_valid, int head_dim,
                                          float scale) {
    auto thr_mma = tiled_mma.get_thread_slice(tid);
    Element *base = reinterpret_cast<Element *>(ptr) + offset;
    Tensor g = make_tensor(make_gmem_ptr(base), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(row_stride, _1{}));
    Tensor tg = thr_mma.partition_C(g);
    Tensor tc = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    const bool pairs_aligned = (reinterpret_cast<uintptr_t>(base) % 4 == 0) && row_stride % 2 == 0;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {  // (i, i + 1): adjacent columns of one row (head_dim is even)
        if (get<0>(tc(i)) < rows_valid && get<1>(tc(i)) < head_dim) {
            const Element lo = Element(acc(i) * scale), hi = Element(acc(i + 1) * scale);
            if (pairs_aligned) {
                cutlass::AlignedArray<Element, 2> pair;  // 4-byte aligned: one store
                pair[0] = lo, pair[1] = hi;
                *reinterpret_cast<cutlass::AlignedArray<Element, 2> *>(&tg(i)) = pair;
            } else {
                tg(i) = lo, tg(i + 1) = hi;
            }
        }
    }
}

// The same through shared memory (smem: a free kBlockN x head_dim tile in SmemLayoutKV), so that
// whole rows leave in 16-byte stores: full sectors, no partial writes. For 16-byte aligned rows;
// every thread calls it (it synchronises the block).
template <typename Traits, typename Acc, typename TiledMma>
__device__ __forceinline__ void store_dkv_staged(Acc &acc, TiledMma const &tiled_mma, typename Traits::Element *smem,
                                                 void *ptr, int64_t offset, int64_t row_stride, int rows_valid,
                                                 int head_dim, float scale) {
    using Element = typename Traits::Element;
    constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    Tensor s = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutKV{});
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) { acc(i) *= scale; }
    Tensor r = convert_type<Element>(acc);
    auto smem_copy = make_tiled_copy_C(typename Traits::SmemCopyAtomAcc{}, tiled_mma);
    auto smem_thr_copy = smem_copy.get_thread_slice(threadIdx.x);
    cute::copy(smem_copy, smem_thr_copy.retile_S(r), smem_thr_copy.partition_D(s));
    __syncthreads();
    typename Traits::GmemTiledCopyO gmem_copy;
    auto gmem_thr_copy = gmem_copy.get_thread_slice(threadIdx.x);
    Tensor g = make_tensor(make_gmem_ptr(reinterpret_cast<Element *>(ptr) + offset),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(row_stride, _1{}));
    Tensor tg = gmem_thr_copy.partition_D(g);
    Tensor tr = make_tensor<Element>(shape(tg));
    cute::copy(gmem_copy, gmem_thr_copy.partition_S(s), tr);
    Tensor tc = gmem_thr_copy.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    Tensor tp = col_predicates(tc, head_dim);
    copy_tile<false>(gmem_copy, tr, tg, tc, tp, rows_valid, head_dim == kHeadDim && rows_valid >= kBlockN);
}

// Adds a query block's dQ (an accumulator of tiled_mma_dq) into its rows of dq_accum (block_row0:
// the block's first dq_accum row), two adjacent columns per vector reduction. tid: the thread's
// index in tiled_mma.
template <typename Traits, typename Acc, typename TiledMma>
__device__ __forceinline__ void add_dq_accum(Acc const &acc_dq, TiledMma const &tiled_mma, unsigned tid,
                                             float *dq_accum_block, int64_t block_row0) {
    constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
    Tensor tc = tiled_mma.get_thread_slice(tid).partition_C(
        make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {  // (i, i + 1): adjacent columns of one row
        const int row = get<0>(tc(i)), col = get<1>(tc(i));
        atomic_add_pair(dq_accum_block + row * kHeadDim + dq_accum_col(block_row0 + row, col), acc_dq(i), acc_dq(i + 1));
    }
}

// The same tile written to shared memory in dq_accum's byte order (then bulk-added, sm90 paths).
// tid: the thread's index in tiled_mma (unsigned: a signed index costs the backward kernel its
// last free registers in the divisions of the partition).
template <int kBlockM, int kHeadDim, typename Acc, typename TiledMma>
__device__ __forceinline__ void stage_dq_accum(Acc const &acc_dq, TiledMma const &tiled_mma, unsigned tid,
                                               float *smem_dq, int64_t block_row0) {
    Tensor tc = tiled_mma.get_thread_slice(tid).partition_C(
        make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {
        const int row = get<0>(tc(i)), col = get<1>(tc(i));
        *reinterpret_cast<float2 *>(smem_dq + row * kHeadDim + dq_accum_col(block_row0 + row, col)) =
            make_float2(acc_dq(i), acc_dq(i + 1));
    }
}

}  // namespace flash
