// Which key blocks one forward CTA walks: those its query block may see under the mask (causal /
// window bound them), and of those, with split-KV, the contiguous share of its split.
#pragma once

#include "flash.h"
#include "sequence_info.h"
#include "utils.h"

namespace flash {

template <int kBlockM, int kBlockN, bool Is_masked>
struct KeyBlockRange {
    int n_block_min, n_block_max;  // [min, max)

    __device__ static KeyBlockRange make(const AttentionParams &params, const SequenceInfo &seq, int m_block,
                                         int split) {
        const int diag = seq.seqlen_k - seq.seqlen_q;
        int lo = 0, hi = ceil_div(max(seq.seqlen_k, 0), kBlockN);
        if constexpr (Is_masked) {
            if (params.window_size_right >= 0) {
                hi = min(hi, ceil_div((m_block + 1) * kBlockM + diag + params.window_size_right, kBlockN));
            }
            if (params.window_size_left >= 0) {
                lo = max(0, (m_block * kBlockM + diag - params.window_size_left) / kBlockN);
            }
        }
        if (params.num_splits > 1) {
            const int per_split = ceil_div(max(hi - lo, 0), params.num_splits);
            lo += split * per_split;
            hi = min(hi, lo + per_split);
        }
        return {lo, hi};
    }

    __device__ bool empty() const { return n_block_max <= n_block_min; }
};

}  // namespace flash
