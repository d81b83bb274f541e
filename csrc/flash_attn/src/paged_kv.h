// Paged K/V (block_table): where each row of a key block lives. One thread per row looks the rows
// of a key block up (its page in the block table, its row in the page) two blocks ahead of the
// loads that use them, holds them in a register for an iteration and then leaves them in shared
// memory; the K and the V load of that block read their row offsets from there. So the block table
// is read once per key block, and its latency (an L2 read queued behind the K/V traffic) overlaps a
// whole iteration: no load and no barrier waits on it.
#pragma once

#include "flash.h"
#include "sequence_info.h"

namespace flash {

template <int kBlockN>
struct PagedRows {
    static constexpr int kSmemSize = 2 * 2 * kBlockN * int(sizeof(int));  // two blocks' page, in_page

    struct Row {
        int page, in_page;
    };

    int *page;     // [2][kBlockN]: the page of each row of two key blocks (by n_block % 2)
    int *in_page;  // [2][kBlockN]: its row in the page

    __device__ explicit PagedRows(int *smem) : page(smem), in_page(smem + 2 * kBlockN) {}

    // Row `tidx` of key block n_block (a row past the keys reads no table entry). Threads past
    // kBlockN have no row.
    __device__ __forceinline__ Row fetch(const AttentionParams &params, const SequenceInfo &seq, int bidb,
                                         int n_block, int tidx) const {
        const int row = n_block * kBlockN + tidx;
        if (tidx >= kBlockN || row >= seq.seqlen_k) { return {0, 0}; }
        const int logical = seq.k_first_row + row;
        const int slot = logical / params.page_block_size;
        return {params.block_table[int64_t(bidb) * params.block_table_batch_stride + slot],
                logical - slot * params.page_block_size};
    }

    // The caller meets the readers at a barrier after this.
    __device__ __forceinline__ void store(int n_block, int tidx, Row row) const {
        if (tidx < kBlockN) {
            page[(n_block & 1) * kBlockN + tidx] = row.page;
            in_page[(n_block & 1) * kBlockN + tidx] = row.in_page;
        }
    }

    // Element offset of row r of key block n_block past where a contiguous window at the head's
    // base would put it (r rows in).
    __device__ __forceinline__ int64_t shift(int n_block, int r, int64_t batch_stride, int64_t row_stride) const {
        const int i = (n_block & 1) * kBlockN + r;
        return int64_t(page[i]) * batch_stride + int64_t(in_page[i] - r) * row_stride;
    }
};

}  // namespace flash
