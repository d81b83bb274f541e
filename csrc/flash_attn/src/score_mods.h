// The score modifications of an S tile, in flash-attn's order: softcap (tanh), ALiBi, then the
// mask. The forward and the backward (which rebuilds P from S) apply them through this one piece;
// the backward also takes the softcap's derivative (tanh_derivative) at the point the tanh is known.
#pragma once

#include <cute/tensor.hpp>

#include "flash.h"
#include "mask.h"
#include "sequence_info.h"
#include "utils.h"

namespace flash {

using namespace cute;

__device__ __forceinline__ float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

struct ScoreMods {
    AttentionMask mask;
    float softcap_input_scale;
    bool has_softcap, has_alibi;

    __device__ static ScoreMods make(const AttentionParams &params, const SequenceInfo &seq, int bidb, int bidh) {
        return {AttentionMask::make(params, seq, bidb, bidh), params.softcap_input_scale, params.softcap > 0.f,
                params.alibi_slopes_ptr != nullptr};
    }

    // acc_s: this thread's S accumulator; scores: the same registers as (rows, cols), coords their
    // (row, col) in the (kBlockM, kBlockN) tile at (m_block, n_block). after_tanh() runs once the
    // softcap's tanh is in acc_s. Interior tiles of plain attention skip everything with one
    // uniform branch.
    template <int kBlockM, int kBlockN, bool Is_masked, typename Acc, typename TS, typename TC, typename AfterTanh>
    __device__ __forceinline__ void apply(Acc &acc_s, TS &scores, TC const &coords, int m_block, int n_block,
                                          AfterTanh after_tanh) const {
        const int row_first = m_block * kBlockM, col_first = n_block * kBlockN;
        const bool needs_mask = mask.tile_needs_mask<Is_masked>(row_first, row_first + kBlockM - 1, col_first,
                                                                 col_first + kBlockN - 1);
        if (!(has_softcap || has_alibi || needs_mask)) { return; }
        if (has_softcap) {
            CUTE_UNROLL
            for (int i = 0; i < size(acc_s); ++i) { acc_s(i) = fast_tanh(acc_s(i) * softcap_input_scale); }
            after_tanh();
        }
        if (has_alibi) {
            mask.apply<Is_masked, true>(scores, coords, row_first, col_first, needs_mask);
        } else if (needs_mask) {
            mask.apply<Is_masked, false>(scores, coords, row_first, col_first, true);
        }
    }

    // The softcap's derivative where acc_tanh holds the tanh (in apply's after_tanh): d tanh(x) / dx
    // = 1 - tanh^2, in the input dtype, in which the backward keeps it until dS.
    template <typename Element, typename Acc>
    __device__ __forceinline__ static auto tanh_derivative(Acc const &acc_tanh) {
        Tensor dtanh = make_tensor<float>(acc_tanh.layout());
        CUTE_UNROLL
        for (int i = 0; i < size(acc_tanh); ++i) { dtanh(i) = 1.f - acc_tanh(i) * acc_tanh(i); }
        return convert_type<Element>(dtanh);
    }
};

}  // namespace flash
