// The score mask of one (query block, key block) tile: key-length bound, causal / sliding window,
// and the ALiBi bias. Works on an accumulator seen as (rows, cols) (see acc_as_rowcol) together
// with the (row, col) coordinates of each of its elements, so any tiled MMA can use it.
#pragma once

#include <cute/tensor.hpp>

#include "flash.h"
#include "sequence_info.h"

namespace flash {

using namespace cute;

struct AttentionMask {
    // Keys j of query i stay in [i + diag - window_left, i + diag + window_right] with
    // diag = seqlen_k - seqlen_q (bottom-right alignment); a negative window is unbounded.
    int seqlen_k, diag, window_left, window_right;
    float alibi_slope;  // divided by score_scale: the bias is added to the S accumulator

    // The mask of head bidh of batch entry bidb.
    __device__ static AttentionMask make(const AttentionParams &params, const SequenceInfo &seq, int bidb, int bidh) {
        const float slope = params.alibi_slopes_ptr == nullptr
            ? 0.f
            : params.alibi_slopes_ptr[bidb * params.alibi_slopes_batch_stride + bidh] / params.score_scale;
        return {seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, params.window_size_left, params.window_size_right, slope};
    }

    // Does the tile of rows [row_first, row_last] and columns [col_first, col_last] contain any
    // position the mask changes?
    template <bool Is_masked>
    __device__ __forceinline__ bool tile_needs_mask(int row_first, int row_last, int col_first, int col_last) const {
        if (col_last >= seqlen_k) { return true; }
        if constexpr (Is_masked) {
            if (window_right >= 0 && col_last > row_first + diag + window_right) { return true; }
            if (window_left >= 0 && col_first < row_last + diag - window_left) { return true; }
        }
        return false;
    }

    // scores: this thread's elements of the tile, (rows, cols); coords: their (row, col) inside
    // the tile, same shape; the tile starts at (row_offset, col_offset). With `bounds`, masked
    // positions become -inf.
    template <bool Is_masked, bool Has_alibi, typename TS, typename TC>
    __device__ __forceinline__ void apply(TS &scores, TC const &coords, int row_offset, int col_offset,
                                          bool bounds) const {
        CUTE_UNROLL
        for (int r = 0; r < size<0>(scores); ++r) {
            const int row = row_offset + get<0>(coords(r, 0));
            int col_lo = 0, col_hi = seqlen_k;
            if constexpr (Is_masked) {
                if (window_left >= 0) { col_lo = max(col_lo, row + diag - window_left); }
                if (window_right >= 0) { col_hi = min(col_hi, row + diag + window_right + 1); }
            }
            CUTE_UNROLL
            for (int c = 0; c < size<1>(scores); ++c) {
                const int col = col_offset + get<1>(coords(r, c));
                if constexpr (Has_alibi) { scores(r, c) -= alibi_slope * float(abs(row + diag - col)); }
                if (bounds && (col < col_lo || col >= col_hi)) { scores(r, c) = -INFINITY; }
            }
        }
    }
};

}  // namespace flash
