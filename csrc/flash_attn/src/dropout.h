// Dropout on one tile of attention probabilities, reproducible from (seed, offset) alone.
//
// The random number of an element depends only on its position. Rows and columns are cut in
// 16x16 cells; inside a cell the eight elements that one lane holds in the m16n8 accumulator
// layout (rows r and r + 8, columns 2c, 2c + 1, 2c + 8, 2c + 9, with lane = 4r + c) share one
// Philox call and take one 16-bit half each. Philox counter: high word = (batch, head, cell row),
// low word = offset + 32 * cell column + lane, so one launch uses 32 * (seqlen_k_rounded / 16)
// consecutive offsets per (batch, head, cell row): dropout_offsets_per_launch in flash.h.
#pragma once

#include <cute/tensor.hpp>

#include "flash.h"
#include "philox.h"

namespace flash {

using namespace cute;

struct Dropout {
    uint64_t seed, offset;
    uint64_t cell_row_base;  // (batch * heads + head) * cell rows per head
    uint32_t keep_threshold;

    __device__ Dropout(const AttentionParams &params, uint64_t seed_, uint64_t offset_, int bidb, int bidh)
        : seed(seed_), offset(offset_),
          cell_row_base((uint64_t(bidb) * params.heads + bidh) * uint64_t(params.seqlen_q_rounded / 16)),
          keep_threshold(params.dropout_keep_threshold) {}

    __device__ __forceinline__ uint4 random_cell(int cell_row, int cell_col, int lane) const {
        return philox4x32_10(seed, cell_row_base + uint64_t(cell_row),
                             offset + uint64_t(cell_col) * 32 + uint64_t(lane));
    }

    // scores: this thread's (rows, cols) view of the tile, after exp. row16/col16: the 16-aligned
    // row of atom mi = 0 and column of atom nj = 0; atoms step by row_stride rows and 8 columns.
    // Dropped elements become 0. With Write_probs, every element is also stored, negated when
    // dropped, to s_dmask (the (batch, head) matrix of S_dmask, ld = its row length).
    template <bool Write_probs, typename Element, typename Tensor>
    __device__ __forceinline__ void apply(Tensor &scores, int row16, int col16, int row_stride, int lane,
                                          Element *s_dmask, int64_t ld) const {
        static_assert(decltype(size<1, 1>(scores))::value % 2 == 0);
        CUTE_UNROLL
        for (int mi = 0; mi < size<0, 1>(scores); ++mi) {
            const int cell_row_start = row16 + mi * row_stride;
            CUTE_UNROLL
            for (int c = 0; c < size<1, 1>(scores) / 2; ++c) {
                const uint4 bits = random_cell(cell_row_start / 16, col16 / 16 + c, lane);
                const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
                CUTE_UNROLL
                for (int i = 0; i < 2; ++i) {
                    CUTE_UNROLL
                    for (int half = 0; half < 2; ++half) {
                        const int nj = 2 * c + half;
                        Element kept_or_not[2];
                        CUTE_UNROLL
                        for (int j = 0; j < 2; ++j) {
                            const int slot = i * 4 + half * 2 + j;
                            const uint32_t r = (words[slot / 2] >> (16 * (slot % 2))) & 0xFFFFu;
                            float &p = scores(make_coord(i, mi), make_coord(j, nj));
                            const bool keep = r < keep_threshold;
                            if constexpr (Write_probs) { kept_or_not[j] = Element(keep ? p : -p); }
                            if (!keep) { p = 0.f; }
                        }
                        if constexpr (Write_probs) {
                            const int row = cell_row_start + lane / 4 + i * 8;
                            const int col = col16 + nj * 8 + (lane % 4) * 2;
                            Element *dst = s_dmask + row * ld + col;
                            dst[0] = kept_or_not[0];
                            dst[1] = kept_or_not[1];
                        }
                    }
                }
            }
        }
    }
};

}  // namespace flash
