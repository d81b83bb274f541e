// Online softmax over key blocks: running row max and row sum, rescaling of the output
// accumulator, and the final normalisation with the log-sum-exp; and the softmax's gradient.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "utils.h"

namespace flash {

using namespace cute;

template <int kRows>
struct OnlineSoftmax {
    // Per thread-row state. row_sum is this thread's partial sum; the quad reduces it once, at
    // the end, instead of every block.
    float row_max[kRows];
    float row_sum[kRows];

    __device__ __forceinline__ OnlineSoftmax() {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }
    }

    // scores (rows, cols) of one key block -> unnormalised probabilities exp(s - max), in base 2
    // with the scale folded into one FFMA; acc_o (rows, head_dim) is rescaled to the new max.
    template <typename TS, typename TO>
    __device__ __forceinline__ void update(TS &scores, TO &acc_o, float scale_log2) {
        float rescale[kRows];
        update_scores(scores, rescale, scale_log2);
        rescale_o(acc_o, rescale);
    }

    // update() in two halves, for a caller whose acc_o is still being accumulated into (by a
    // wgmma in flight) while the scores are exponentiated: each row's factor, then rescale_o.
    template <typename TS>
    __device__ __forceinline__ void update_scores(TS &scores, float (&rescale)[kRows], float scale_log2) {
        static_assert(decltype(size<0>(scores))::value == kRows);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            float block_max = row_max[r];
            CUTE_UNROLL
            for (int c = 0; c < size<1>(scores); ++c) { block_max = fmaxf(block_max, scores(r, c)); }
            block_max = quad_allreduce(block_max, MaxOp{});
            // A row with every key masked so far keeps max -inf; use 0 so exp gives 0, not NaN.
            const float max_scaled = block_max == -INFINITY ? 0.f : block_max * scale_log2;
            rescale[r] = exp2f(row_max[r] * scale_log2 - max_scaled);
            row_max[r] = block_max;
            row_sum[r] *= rescale[r];
            float sum = 0.f;
            CUTE_UNROLL
            for (int c = 0; c < size<1>(scores); ++c) {
                scores(r, c) = exp2f(scores(r, c) * scale_log2 - max_scaled);
                sum += scores(r, c);
            }
            row_sum[r] += sum;
        }
    }

    template <typename TO>
    __device__ __forceinline__ void rescale_o(TO &acc_o, const float (&rescale)[kRows]) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(acc_o); ++c) { acc_o(r, c) *= rescale[r]; }
        }
    }

    // Normalises acc_o and returns each row's log-sum-exp in natural-log units; rows that saw
    // no key get output 0 and lse empty_lse (+inf for a final result, so the backward gives them
    // no gradient; -inf for a split-KV partial, so the combine gives them no weight).
    template <typename TO>
    __device__ __forceinline__ void finalize(TO &acc_o, float score_scale, float out_scale,
                                             float (&lse)[kRows], float empty_lse) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            const float sum = quad_allreduce(row_sum[r], SumOp{});
            const bool empty = sum == 0.f || sum != sum;
            const float inv = empty ? 1.f : out_scale / sum;
            lse[r] = empty ? empty_lse : row_max[r] * score_scale + __logf(sum);
            CUTE_UNROLL
            for (int c = 0; c < size<1>(acc_o); ++c) { acc_o(r, c) *= inv; }
        }
    }
};

// The softmax's gradient at one element, as both backward kernels take it: dS = P (dP - softmax_d),
// softmax_d = rowsum(dO * O). With dropout, p comes negated where the forward dropped it: dS = |p|
// (dP / keep_prob, or 0 where dropped, - softmax_d), and p becomes P with dropped elements zeroed
// (what dV takes; its 1 / keep_prob is applied once, at the end). With softcap, times the tanh's
// derivative.
template <bool Is_dropout, bool Has_softcap>
__device__ __forceinline__ float softmax_grad(float &p, float dp, float softmax_d, float inv_keep_prob, float dtanh) {
    float ds;
    if constexpr (Is_dropout) {
        const bool kept = p >= 0.f;
        ds = fabsf(p) * ((kept ? dp * inv_keep_prob : 0.f) - softmax_d);
        p = kept ? p : 0.f;
    } else {
        ds = p * (dp - softmax_d);
    }
    if constexpr (Has_softcap) { ds *= dtanh; }
    return ds;
}

}  // namespace flash
