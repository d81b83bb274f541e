// Where a forward CTA's results go: O normalised and its log-sum-exp (one CTA per query block),
// or, with split-KV, this split's O normalised by its own row sums and its lse, in fp32, for the
// combine kernel (flash_combine.cu) to merge. Rows that see no key: O = 0 and lse = +inf when
// final, lse = -inf in a split (the combine then gives them no weight).
#pragma once

#include <cute/tensor.hpp>

#include "flash.h"
#include "sequence_info.h"
#include "utils.h"

namespace flash {

using namespace cute;

// Row (split, batch, head, row) of oaccum / softmax_lse_accum (split-KV is padded-layout only).
__device__ __forceinline__ int64_t accum_row(const AttentionParams &params, int split, int bidb, int bidh,
                                             int row) {
    return ((int64_t(split) * params.batch + bidb) * params.heads + bidh) * params.seqlen_q + row;
}

// Writes this thread's part of an O tile (registers, laid out like gO's partition) to global
// memory: rows below rows_valid, columns below the head dim.
template <typename Traits, typename TensorR, typename TensorG>
__device__ __forceinline__ void store_o_tile(const AttentionParams &params, TensorR const &tOrO, TensorG &tOgO,
                                             int rows_valid) {
    constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
    typename Traits::GmemTiledCopyO gmem_tiled_copy_O;
    auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(threadIdx.x);
    Tensor tOcO = gmem_thr_copy_O.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tOpO = col_predicates(tOcO, params.head_dim);
    const bool full = params.head_dim == kHeadDim && rows_valid >= kBlockM;
    copy_tile<false>(gmem_tiled_copy_O, tOrO, tOgO, tOcO, tOpO, rows_valid, full);
}

// The query block sees no key at all (causal/window with seqlen_q > seqlen_k, an empty key
// sequence, or an empty split): the output of a final result, or a split's no-weight partial.
template <typename Traits, typename TensorGO>
__device__ void write_empty_rows(const AttentionParams &params, const SequenceInfo &seq, TensorGO &gO,
                                 int m_block, int bidb, int bidh, int split) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    const int rows_valid = min(kBlockM, seq.seqlen_q - m_block * kBlockM);
    if (params.num_splits > 1) {
        for (int i = threadIdx.x; i < rows_valid * params.head_dim; i += Traits::kNThreads) {
            const int row = m_block * kBlockM + i / params.head_dim;
            params.oaccum_ptr[accum_row(params, split, bidb, bidh, row) * params.head_dim + i % params.head_dim] = 0.f;
        }
        for (int r = threadIdx.x; r < rows_valid; r += Traits::kNThreads) {
            params.softmax_lse_accum_ptr[accum_row(params, split, bidb, bidh, m_block * kBlockM + r)] = -INFINITY;
        }
        return;
    }
    typename Traits::GmemTiledCopyO gmem_tiled_copy_O;
    Tensor tOgO = gmem_tiled_copy_O.get_thread_slice(threadIdx.x).partition_D(gO);
    Tensor tOrO = make_tensor<Element>(shape(tOgO));
    clear(tOrO);
    store_o_tile<Traits>(params, tOrO, tOgO, rows_valid);
    for (int r = threadIdx.x; r < rows_valid; r += Traits::kNThreads) {
        params.softmax_lse_ptr[lse_index(params, seq, bidb, bidh, m_block * kBlockM + r)] = INFINITY;
    }
}

// Split-KV: this thread's O elements (fp32, normalised by the split's row sums) and, from the
// lane holding each row's first column, its lse. acc_o_rc and coords_rc are (rows, cols) views of
// the accumulator and of its elements' (row, col) in the tile.
template <int kBlockM, int kRows, typename TensorO, typename TensorC>
__device__ void store_partial(const AttentionParams &params, const SequenceInfo &seq, TensorO const &acc_o_rc,
                              TensorC const &coords_rc, const float (&lse)[kRows], int m_block, int bidb,
                              int bidh, int split) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
        const int row = m_block * kBlockM + get<0>(coords_rc(r, 0));
        if (row >= seq.seqlen_q) { continue; }
        const int64_t base = accum_row(params, split, bidb, bidh, row);
        CUTE_UNROLL
        for (int c = 0; c < size<1>(acc_o_rc); ++c) {
            const int col = get<1>(coords_rc(r, c));
            if (col < params.head_dim) { params.oaccum_ptr[base * params.head_dim + col] = acc_o_rc(r, c); }
        }
        if (get<1>(coords_rc(r, 0)) == 0) { params.softmax_lse_accum_ptr[base] = lse[r]; }
    }
}

}  // namespace flash
