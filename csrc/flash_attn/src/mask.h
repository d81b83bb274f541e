// The score mask of one (m_block, n_block) tile: key-length bound, causal / sliding window, and
// the ALiBi bias. Works on the accumulator seen as (rows, cols) (see acc_as_rowcol).
#pragma once

#include <cute/tensor.hpp>

namespace flash {

using namespace cute;

struct AttentionMask {
    // Keys j of query i stay in [i + diag - window_left, i + diag + window_right] with
    // diag = seqlen_k - seqlen_q (bottom-right alignment); a negative window is unbounded.
    int seqlen_k, diag, window_left, window_right;
    float alibi_slope;  // already divided by the softmax scale: the bias is added to raw scores

    // Does tile (m_block, n_block) contain any position the mask changes?
    template <bool Is_masked, int kBlockM, int kBlockN>
    __device__ __forceinline__ bool tile_needs_mask(int m_block, int n_block) const {
        if ((n_block + 1) * kBlockN > seqlen_k) { return true; }
        if constexpr (Is_masked) {
            const int col_last = (n_block + 1) * kBlockN - 1, col_first = n_block * kBlockN;
            const int row_first = m_block * kBlockM, row_last = (m_block + 1) * kBlockM - 1;
            if (window_right >= 0 && col_last > row_first + diag + window_right) { return true; }
            if (window_left >= 0 && col_first < row_last + diag - window_left) { return true; }
        }
        return false;
    }

    // scores: this thread's part of the tile, (rows, cols). row0/col0: absolute position of its
    // first element; rows step by 8 within an atom and row_stride between atoms, columns by 1
    // within a pair and 8 between atoms.
    template <bool Is_masked, bool Has_alibi, typename Tensor>
    __device__ __forceinline__ void apply(Tensor &scores, int row0, int col0, int row_stride,
                                          bool bounds) const {
        CUTE_UNROLL
        for (int mi = 0; mi < size<0, 1>(scores); ++mi) {
            CUTE_UNROLL
            for (int i = 0; i < size<0, 0>(scores); ++i) {
                const int row = row0 + mi * row_stride + i * 8;
                int col_lo = 0, col_hi = seqlen_k;
                if constexpr (Is_masked) {
                    if (window_left >= 0) { col_lo = max(col_lo, row + diag - window_left); }
                    if (window_right >= 0) { col_hi = min(col_hi, row + diag + window_right + 1); }
                }
                CUTE_UNROLL
                for (int nj = 0; nj < size<1, 1>(scores); ++nj) {
                    CUTE_UNROLL
                    for (int j = 0; j < size<1, 0>(scores); ++j) {
                        const int col = col0 + nj * 8 + j;
                        auto &s = scores(make_coord(i, mi), make_coord(j, nj));
                        if constexpr (Has_alibi) { s -= alibi_slope * float(abs(row + diag - col)); }
                        if (bounds && (col < col_lo || col >= col_hi)) { s = -INFINITY; }
                    }
                }
            }
        }
    }
};

}  // namespace flash
