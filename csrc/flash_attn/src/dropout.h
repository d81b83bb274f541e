// Dropout on one tile of attention probabilities, reproducible from (seed, offset) alone.
//
// The random number of an element depends only on its position. Rows and columns are cut in
// 16x16 cells; inside a cell the eight elements that one lane holds in the m16n8 accumulator
// layout (rows r and r + 8, columns 2c, 2c + 1, 2c + 8, 2c + 9, with lane = 4r + c) share one
// Philox call and take one 16-bit half each. Any tiled MMA whose warps own 16-column slices
// (two adjacent n8 atoms) holds whole cells per lane, so forward and backward kernels with
// different tilings draw the same mask. Philox counter: high word = (batch, head, cell row),
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

    __host__ __device__ Dropout(const AttentionParams &params, uint64_t seed_, uint64_t offset_, int bidb, int bidh)
        : seed(seed_), offset(offset_),
          cell_row_base((uint64_t(bidb) * params.heads + bidh) * uint64_t(params.seqlen_q_rounded / 16)),
          keep_threshold(params.dropout_keep_threshold) {}

    __host__ __device__ __forceinline__ uint4 random_cell(int cell_row, int cell_col, int lane) const {
        return philox4x32_10(seed, cell_row_base + uint64_t(cell_row),
                             offset + uint64_t(cell_col) * 32 + uint64_t(lane));
    }

    // scores: this thread's (rows, cols) view of an m16n8 accumulator tile, after exp; coords:
    // the (row, col) of each element inside the tile, which starts at (row_offset, col_offset).
    // Dropped elements become 0 (Negate_dropped: -p, which keeps p for the backward's dS).
    // With Write_probs every element is also stored, negated when dropped, to s_dmask (the
    // (batch, head) matrix of S_dmask, ld = its row length).
    template <bool Negate_dropped, bool Write_probs, typename Element, typename TS, typename TC>
    __host__ __device__ __forceinline__ void apply(TS &scores, TC const &coords, int row_offset, int col_offset,
                                                   int lane, Element *s_dmask, int64_t ld) const {
        // Rows: (2 halves, atoms); columns: (2 of a pair, atoms), atoms 2c and 2c + 1 side by side.
        constexpr int kAtomsM = decltype(size<0, 1>(scores))::value;
        constexpr int kAtomsN = decltype(size<1, 1>(scores))::value;
        static_assert(kAtomsN % 2 == 0);
        CUTE_UNROLL
        for (int mi = 0; mi < kAtomsM; ++mi) {
            CUTE_UNROLL
            for (int c = 0; c < kAtomsN / 2; ++c) {
                const auto first = coords(make_coord(0, mi), make_coord(0, 2 * c));
                const uint4 bits = random_cell((row_offset + get<0>(first)) / 16,
                                               (col_offset + get<1>(first)) / 16, lane);
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
                            if (!keep) { p = Negate_dropped ? -p : 0.f; }
                        }
                        if constexpr (Write_probs) {
                            const auto pos = coords(make_coord(i, mi), make_coord(0, nj));
                            Element *dst = s_dmask + int64_t(row_offset + get<0>(pos)) * ld + col_offset + get<1>(pos);
                            dst[0] = kept_or_not[0];
                            dst[1] = kept_or_not[1];
                        }
                    }
                }
            }
        }
    }

    // The same mask on a transposed tile, S^T (rows = keys, columns = queries; the warp-specialised
    // backward), whose lanes hold the same m16n8 pattern over (key, query): lane L holds keys L / 4
    // (+ 8) and queries 2 (L % 4) (+ 1, + 8, + 9) of a cell. The forward gave query q and key k to
    // lane 4 (q % 8) + (k % 8) / 2, slot 4 ((q % 16) / 8) + 2 ((k % 16) / 8) + k % 2: here the lanes
    // 8 (L % 4) + L / 8 (even queries) and 4 more (odd ones), slots 4 (query half) + 2 (key half) +
    // (L / 4) % 2. Two Philox calls per cell instead of one. coords: each element's (key, query).
    template <bool Negate_dropped, typename TS, typename TC>
    __host__ __device__ __forceinline__ void apply_transposed(TS &scores_t, TC const &coords, int key_offset,
                                                              int query_offset, int lane) const {
        constexpr int kAtomsM = decltype(size<0, 1>(scores_t))::value;
        constexpr int kAtomsN = decltype(size<1, 1>(scores_t))::value;
        static_assert(kAtomsN % 2 == 0);
        const int lane_even = 8 * (lane % 4) + lane / 8, key_bit = (lane / 4) % 2;
        CUTE_UNROLL
        for (int mi = 0; mi < kAtomsM; ++mi) {
            CUTE_UNROLL
            for (int c = 0; c < kAtomsN / 2; ++c) {
                const auto first = coords(make_coord(0, mi), make_coord(0, 2 * c));
                const int cell_row = (query_offset + get<1>(first)) / 16, cell_col = (key_offset + get<0>(first)) / 16;
                const uint4 bits[2] = {random_cell(cell_row, cell_col, lane_even),
                                       random_cell(cell_row, cell_col, lane_even + 4)};
                CUTE_UNROLL
                for (int j = 0; j < 2; ++j) {  // even / odd query: its forward lane
                    const uint32_t words[4] = {bits[j].x, bits[j].y, bits[j].z, bits[j].w};
                    CUTE_UNROLL
                    for (int i = 0; i < 2; ++i) {  // key half of the cell
                        CUTE_UNROLL
                        for (int half = 0; half < 2; ++half) {  // query half of the cell
                            const int slot = 4 * half + 2 * i + key_bit;
                            const uint32_t r = (words[slot / 2] >> (16 * (slot % 2))) & 0xFFFFu;
                            float &p = scores_t(make_coord(i, mi), make_coord(j, 2 * c + half));
                            if (r >= keep_threshold) { p = Negate_dropped ? -p : 0.f; }
                        }
                    }
                }
            }
        }
    }
};

}  // namespace flash
