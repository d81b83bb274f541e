// The warp-specialised forward's epilogue (flash_fwd_ws_kernel.h): each consumer warpgroup's 64
// rows of O, normalised, and their log-sum-exp. Where ForwardWs::kStagedO says (d64, d128) the rows
// go through a staging tile and one asynchronous TMA store (WsStagedO), so that the consumer's next
// query block runs while they are written; else straight from registers. (On the H200 the stores from
// registers held the consumers up: the d128 forward at 2K keys ran 9% faster, causal 14%, with no
// O stored at all.)
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "flash.h"
#include "sequence_info.h"
#include "tma_rows.h"
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
// a staging tile of its consumer (Ws::SmemLayoutOStage, what the TMA store reads), in bytes.
template <typename Ws>
__host__ __device__ constexpr int ws_o_stage_byte(int row, int col) {
    typename Ws::SmemLayoutOStage tile;  // the swizzle (layout_a) acts on byte offsets
    return int(tile.layout_a()(int(tile.layout_b()(row % 64, col)) * int(sizeof(typename Ws::Element))));
}

// The staged epilogue (Ws::kStagedO). Each consumer writes its 64 rows of O, normalised, into one
// of its two staging tiles at the end of a query block; the TMA store of that tile is issued by the
// consumer's first thread at the start of its next query block (or after its last), behind a
// barrier of the consumer's 128 threads that also tells them the store before it has read the
// other tile, which the block then writes. (ptxas moved the main loop's wgmma descriptors through
// vector registers, two R2UR a P V wgmma, with this barrier at the block's end, after the loop, or
// chosen by a branch between two ids; the landed d128 staged epilogue had both.)
struct WsStagedO {
    int tile = 0;          // the tile the next block writes
    bool pending = false;  // a written tile waits for its store
    int row0 = 0, bidh = 0, bidb = 0, q_start = 0;  // where: the consumer's first row, in sequence rows

    // Barriers 4.. (after the turns' 1..3): one a consumer.
    __device__ static void consumer_sync(int consumer) { named_barrier_sync<128>(4 + consumer); }

    // At the start of a query block and after the last: the pending tile's store, issued.
    template <typename Ws, typename TmaO>
    __device__ __forceinline__ void issue(const AttentionParams &params, TmaO const &tma_o,
                                          typename Ws::Element *tiles, int consumer, int wg_thread) {
        if (wg_thread == 0) { tma_store_wait<0>(); }  // every store issued so far has read its tile
        consumer_sync(consumer);                        // and every thread has written the pending one
        if (pending && wg_thread == 0) {
            Tensor mO = tma_o.get_tma_tensor(q_rows_shape(params));
            Tensor gO = local_tile(sequence_rows(mO, q_start, bidh, bidb), Shape<_64, Int<Ws::kHeadDim>>{},
                                   make_coord(row0 / 64, _0{}));
            Tensor sO = make_tensor(make_smem_ptr(tiles + (1 - tile) * cosize_v<typename Ws::SmemLayoutOStage>),
                                    typename Ws::SmemLayoutOStage{});
            auto [tOgO, tOsO] = tma_partition(tma_o, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sO),
                                              group_modes<0, 2>(gO));
            copy(tma_o, tOsO, tOgO);
            tma_store_arrive();
        }
        pending = false;
    }

    // At the end of a query block: the consumer's rows of O into its tile (whose last store has read
    // it: issue() at this block's start), or from registers where a varlen consumer's rows run past
    // its sequence (the next sequence's rows follow; padded inputs: rows past seqlen_q are past the
    // tensor's extent, which the store does not write). And the rows' log-sum-exp.
    template <typename Ws, typename Acc, typename TC, int kRows>
    __device__ __forceinline__ void write(const AttentionParams &params, const SequenceInfo &seq,
                                          Acc const &acc_o_rowcol, TC const &tOcO_rc, const float (&lse)[kRows],
                                          int m_block, int bidb_, int bidh_, typename Ws::Element *tiles,
                                          int consumer, int wg_thread) {
        using Element = typename Ws::Element;
        const int consumer_row0 = m_block * Ws::kBlockM + consumer * 64;
        if (consumer_row0 >= seq.seqlen_q) { return; }
        if (params.cu_seqlens_q != nullptr && consumer_row0 + 64 > seq.seqlen_q) {
            ws_store_o<Ws>(params, seq, acc_o_rowcol, tOcO_rc, lse, m_block, bidb_, bidh_);
            return;
        }
        char *tile_bytes = reinterpret_cast<char *>(tiles + tile * cosize_v<typename Ws::SmemLayoutOStage>);
        // The swizzled places of this thread's pairs, derived here: hoisted out of the query-block
        // loop they held registers through it (the d128 kernel spilled).
        Tensor tOcO_stage = typename Ws::TiledMmaO{}.get_thread_slice(computed_here(consumer * 128 + wg_thread))
                                .partition_C(make_identity_tensor(Shape<Int<Ws::kBlockM>, Int<Ws::kHeadDim>>{}));
        Tensor tOcO_stage_rc = make_tensor(tOcO_stage.data(), acc_as_rowcol(tOcO_stage.layout()));
        CUTE_UNROLL
        for (int r = 0; r < size<0>(acc_o_rowcol); ++r) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(acc_o_rowcol); c += 2) {
                cutlass::AlignedArray<Element, 2> pair;
                pair[0] = Element(acc_o_rowcol(r, c)), pair[1] = Element(acc_o_rowcol(r, c + 1));
                const int byte = ws_o_stage_byte<Ws>(get<0>(tOcO_stage_rc(r, c)), get<1>(tOcO_stage_rc(r, c)));
                *reinterpret_cast<cutlass::AlignedArray<Element, 2> *>(tile_bytes + byte) = pair;
            }
            const int seq_row = m_block * Ws::kBlockM + get<0>(tOcO_rc(r, 0));
            if (get<1>(tOcO_rc(r, 0)) == 0 && seq_row < seq.seqlen_q) {
                params.softmax_lse_ptr[lse_index(params, seq, bidb_, bidh_, seq_row)] = lse[r];
            }
        }
        cutlass::arch::fence_view_async_shared();  // the tile, visible to the TMA store
        pending = true;
        tile = 1 - tile;
        row0 = consumer_row0, bidh = bidh_, bidb = bidb_, q_start = seq.q_start;
    }
};

}  // namespace flash
