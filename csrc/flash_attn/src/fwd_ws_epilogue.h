// The warp-specialised forward's epilogue (flash_fwd_ws_kernel.h): each consumer warpgroup's 64
// rows of O, normalised, and their log-sum-exp. Where ForwardWs::kStagedO says (d128) the rows go
// through a staging buffer and one asynchronous bulk copy a row, so that the consumer's
// next query block starts while they are written; else straight from registers. (On the H200 the
// stores from registers held the consumers up: the d128 forward at 2K keys ran 9% faster, causal
// 14%, with no O stored at all.)
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "flash.h"
#include "sequence_info.h"
#include "utils.h"

namespace flash {

using namespace cute;

// Writes the consumers' normalised O (rows past the sequence and columns past head_dim skipped)
// and the log-sum-exp, straight from registers.
template <typename Ws, typename Acc, typename TC, int kRows>
__device__ __forceinline__ void ws_store_o(const AttentionParams &params, const SequenceInfo &seq, Acc const &acc_o_rowcol,
                                           TC const &tOcO_rc, const float (&lse)[kRows], int m_block, int bidb,
                                           int bidh) {
    using Element = typename Ws::Element;
    Element *o = reinterpret_cast<Element *>(params.o_ptr) + seq.q_offset(params.o_batch_stride, params.o_row_stride, bidb) +
                 int64_t(bidh) * params.o_head_stride;
    // Columns (c, c + 1), c even, are adjacent (head_dim is a multiple of 8): one 4-byte store each
    // where O's alignment allows.
    const bool pairs_aligned = reinterpret_cast<uintptr_t>(o) % 4 == 0 && params.o_row_stride % 2 == 0;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(acc_o_rowcol); ++r) {
        const int row = m_block * Ws::kBlockM + get<0>(tOcO_rc(r, 0));
        if (row >= seq.seqlen_q) { continue; }
        CUTE_UNROLL
        for (int c = 0; c < size<1>(acc_o_rowcol); c += 2) {
            const int col = get<1>(tOcO_rc(r, c));
            if (col >= params.head_dim) { continue; }
            Element *dst = o + int64_t(row) * params.o_row_stride + col;
            const Element lo = Element(acc_o_rowcol(r, c)), hi = Element(acc_o_rowcol(r, c + 1));
            if (pairs_aligned) {
                cutlass::AlignedArray<Element, 2> pair;
                pair[0] = lo, pair[1] = hi;
                *reinterpret_cast<cutlass::AlignedArray<Element, 2> *>(dst) = pair;
            } else {
                dst[0] = lo, dst[1] = hi;
            }
        }
        if (get<1>(tOcO_rc(r, 0)) == 0) {  // one lane of the quad writes the row's statistics
            params.softmax_lse_ptr[lse_index(params, seq, bidb, bidh, row)] = lse[r];
        }
    }
}

// Where O's element (row, col) of a query block (rows of every consumer: consumer row / 64) goes in
// its consumer's staging rows, in bytes.
template <typename Ws>
__host__ __device__ constexpr int ws_o_stage_byte(int row, int col) {
    return row % 64 * Ws::kORowBytes + col * int(sizeof(typename Ws::Element));
}

// The staged epilogue's barrier of consumer c's 128 threads (ids 4.., after the turns' 1..3).
__device__ __forceinline__ void ws_consumer_sync(int consumer) {
    if (consumer == 0) {
        named_barrier_sync<4, 128>();
    } else {
        named_barrier_sync<5, 128>();
    }
}

// ws_store_o through shared memory (Ws::kStagedO): the consumer's 64 rows of O, normalised, into
// its staging rows, then one bulk copy a row that exists (threads 0-63 of the warpgroup; rows past
// the sequence, e.g. a varlen sequence's last block, are not copied). The copies of the last block
// must have read the staging rows before they are written again.
template <typename Ws, typename Acc, typename TC, int kRows>
__device__ __forceinline__ void ws_store_o_staged(const AttentionParams &params, const SequenceInfo &seq,
                                                  Acc const &acc_o_rowcol, TC const &tOcO_rc, const float (&lse)[kRows],
                                                  int m_block, int bidb, int bidh, char *stage, int consumer,
                                                  int wg_thread) {
    using Element = typename Ws::Element;
    if (wg_thread < 64) { tma_store_wait<0>(); }
    ws_consumer_sync(consumer);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(acc_o_rowcol); ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(acc_o_rowcol); c += 2) {
            cutlass::AlignedArray<Element, 2> pair;
            pair[0] = Element(acc_o_rowcol(r, c)), pair[1] = Element(acc_o_rowcol(r, c + 1));
            const int byte = ws_o_stage_byte<Ws>(get<0>(tOcO_rc(r, c)), get<1>(tOcO_rc(r, c)));
            *reinterpret_cast<cutlass::AlignedArray<Element, 2> *>(stage + byte) = pair;
        }
        const int seq_row = m_block * Ws::kBlockM + get<0>(tOcO_rc(r, 0));
        if (get<1>(tOcO_rc(r, 0)) == 0 && seq_row < seq.seqlen_q) {
            params.softmax_lse_ptr[lse_index(params, seq, bidb, bidh, seq_row)] = lse[r];
        }
    }
    cutlass::arch::fence_view_async_shared();  // the rows, visible to the bulk copies
    ws_consumer_sync(consumer);
    const int row = m_block * Ws::kBlockM + consumer * 64 + wg_thread;
    if (wg_thread < 64 && row < seq.seqlen_q) {
        Element *o = reinterpret_cast<Element *>(params.o_ptr) +
                     seq.q_offset(params.o_batch_stride, params.o_row_stride, bidb) + int64_t(bidh) * params.o_head_stride +
                     int64_t(row) * params.o_row_stride;
        SM90_BULK_COPY_S2G::copy(stage + wg_thread * Ws::kORowBytes, o, params.head_dim * int(sizeof(Element)));
        tma_store_arrive();
    }
}

}  // namespace flash
